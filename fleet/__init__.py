"""``mixrl-fleet``: sampler groups run where users run fleets.

Ray (``fleet.controller``, ``fleet.replica``): every group's replicas as Ray actors with the
group's resources and its accelerator as a Ray resource, supervised by one detached controller
actor that replaces dead replicas and, with ``--autoscale``, moves replicas between groups by the
trainer's per-group signals (``fleet.autoscale``). Kubernetes and SkyPilot (``fleet.render``):
a Deployment / a task per group. A replica anywhere starts from the trainer's current weight
version (``fleet.weights``), so nothing is staged on the nodes by hand.

This package sits above ``trainer_jax.config`` (it reads the run config the trainer reads) and
``sampler_torch.client``; the trainer never imports it (tests/test_seam.py), and nothing here
imports Ray until a Ray command runs (``render`` works without the ``ray`` extra).
"""
