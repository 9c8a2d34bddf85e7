"""What a rank of a :class:`fastddp.testing.pool.RankPool` runs: calls, one after another, each
in a fresh process group, and between them the state the rank started with put back."""

import faulthandler
import gc
import os
import pickle
import signal
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

from fastddp.distributed import exit_after_shutdown

__all__ = ["serve"]

# fastddp's modules whose attributes a rank puts back after each call.
_RESTORED_PACKAGES = ("fastddp.hooks", "fastddp.fsdp")
_RESTORED_MODULES = (
    "fastddp",
    "fastddp.codecs",
    "fastddp.reduce",
    "fastddp.testing.nccl_sim",
    "fastddp.testing.sim_streams",
)


class _Baseline:
    """What a rank puts back after each call: the state it had when it started."""

    def __init__(self):
        import importlib
        import pkgutil

        names = list(_RESTORED_MODULES)
        for package in _RESTORED_PACKAGES:
            module = importlib.import_module(package)
            names += [package] + [
                f"{package}.{m.name}" for m in pkgutil.iter_modules(module.__path__)
            ]
        self.modules = {}
        self.classes = {}
        for name in names:
            module = importlib.import_module(name)
            self.modules[module] = dict(vars(module))
            for value in vars(module).values():
                if isinstance(value, type) and value.__module__ == name:
                    self.classes[value] = dict(vars(value))
        self.cwd = os.getcwd()
        self.seed = torch.initial_seed()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.warnings = list(warnings.filters)

    def restore(self) -> None:
        for module, saved in self.modules.items():
            now = vars(module)
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    setattr(module, key, value)
        for cls, saved in self.classes.items():
            for key in [k for k in vars(cls) if k not in saved]:
                delattr(cls, key)
            for key, value in saved.items():
                if vars(cls).get(key, _MISSING) is not value:
                    setattr(cls, key, value)
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        os.chdir(self.cwd)
        torch.manual_seed(self.seed)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        warnings.filters[:] = self.warnings
        warnings._filters_mutated()  # "once" and "default" warnings show again


_MISSING = object()


def serve(rank, world_size, conn, port, threads, timeout, restore):
    """Serve the pool's calls on ``conn`` until it says stop or goes away."""
    faulthandler.enable()  # a rank that aborts in C++ still shows where it was in Python
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool asks a hung rank
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    baseline = _Baseline() if restore else None
    # What the rank holds now (torch and fastddp, imported) stays: keep it out of the
    # collector's passes, each of which would otherwise walk it (0.1 CPU-s a pass).
    gc.freeze()
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the pool's process is gone
            break
        if message[0] == "stop":
            break
        _, call, payload, env, cwd = message
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        try:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"call-{call}/", store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
            fn, args = pickle.loads(payload)
            result = fn(rank, world_size, *args)
            dist.barrier()
            try:
                reply = pickle.dumps(("ok", pickle.dumps(result)))
            except Exception as e:
                reply = pickle.dumps(("ok", pickle.dumps(f"<{type(result).__name__}: {e}>")))
            del result
        except BaseException:
            # The pool replaces every rank after a failure: report it and leave at once, which
            # also ends the other ranks' waits on this one.
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            exit_after_shutdown(1)
        # Free what fn built (a DDP model holds the group) while the group still exists, so
        # that its threads are joined here rather than at interpreter shutdown.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        gc.freeze()  # what outlived the call (modules it imported, caches): out of the passes
        if baseline is not None:
            baseline.restore()
        conn.send_bytes(reply)
    exit_after_shutdown()
