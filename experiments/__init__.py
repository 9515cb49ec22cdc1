"""mixrl experiment tools: what reads run directories after the fact.

The ablation sweep (``sweep``: one ``mixrl-train`` process per cell), the results report with its
figures and claims (``report``), and the sampler-pool planner with its exact solver (``plan``,
``plan_solve``). This package sits above the trainer: it imports ``trainer_jax`` (configs, metrics,
and the model where the report's drift analysis runs one, JAX imported only there), and nothing in
``trainer_jax``, ``envs``, ``fleet``, ``convert``, ``mixrl_wire`` or ``sampler_torch`` imports it.
It never imports torch.
"""
