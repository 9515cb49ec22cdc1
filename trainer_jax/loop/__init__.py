"""The training loop as stages, each with a narrow interface and its own state.

One step of process 0's loop (``trainer_jax.train.Trainer._loop``) is: take groups (``modes``:
the take/publish policy, asynchronous or synchronous) -> build the batch (``batches``) -> learn
(``collectives``, which also holds every other collective of the lockstep protocol and the other
processes' side of it) -> publish (``publish``, with its calibration and version probe) ->
evaluate (``evaluate``) -> record (``record``).
"""
