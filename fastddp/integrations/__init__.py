"""Ways to use fastddp's hook from training frameworks.

- :mod:`fastddp.integrations.lightning`: ``FastDDPStrategy``, a Lightning ``DDPStrategy`` that
  registers :func:`fastddp.compress_hook` on every device (Lightning's own ``ddp_comm_hook``
  argument is ignored unless the device is CUDA).
- :mod:`fastddp.integrations.accelerate`: ``register_comm_hook(accelerator, model, state)``,
  for models returned by ``Accelerator.prepare()``.

Each module imports its framework when imported; fastddp itself needs neither.
"""
