"""Per-task CPU of a trio program (bench tool: `bench/netsim_bench.py idle --trace`).

On PYTHONPATH with ATD_WAKEPROF set, every `trio.run` gets an instrument that adds the
thread CPU time (`time.thread_time`) of each task step to the task's name and counts the
steps (wakeups). SIGUSR1 starts a window (resets the counts); SIGUSR2 writes the counts
of the window so far, with the process CPU and main-thread CPU, as JSON to
$ATD_WAKEPROF/<pid>.json. Process CPU not in any task step is the scheduler's own
(epoll, timers) plus worker threads (`trio.to_thread`: process minus main-thread CPU).
"""
from __future__ import annotations

import os

if os.environ.get("ATD_WAKEPROF"):
    import json
    import signal
    import time

    import trio

    _out_dir = os.environ["ATD_WAKEPROF"]
    _state: dict = {"steps": {}, "cpu": {}, "t0": None, "dump": False, "reset": False}

    def _reset() -> None:
        _state.update(steps={}, cpu={}, t0=(time.process_time(), time.thread_time(), time.perf_counter()))

    def _dump() -> None:
        p0, th0, w0 = _state["t0"] or (0.0, 0.0, 0.0)
        doc = {"wall_s": time.perf_counter() - w0, "process_cpu_s": time.process_time() - p0,
               "main_thread_cpu_s": time.thread_time() - th0,
               "tasks": {k: {"cpu_s": v, "steps": _state["steps"][k]} for k, v in _state["cpu"].items()}}
        with open(os.path.join(_out_dir, f"{os.getpid()}.json"), "w") as f:
            json.dump(doc, f)

    class _Prof(trio.abc.Instrument):
        def __init__(self) -> None:
            self.t = 0.0

        def before_task_step(self, task) -> None:
            if _state["reset"]:
                _state["reset"] = False
                _reset()
            if _state["dump"]:
                _state["dump"] = False
                _dump()
            self.t = time.thread_time()

        def after_task_step(self, task) -> None:
            name = task.name
            _state["cpu"][name] = _state["cpu"].get(name, 0.0) + time.thread_time() - self.t
            _state["steps"][name] = _state["steps"].get(name, 0) + 1

    signal.signal(signal.SIGUSR1, lambda *_: _state.update(reset=True))
    signal.signal(signal.SIGUSR2, lambda *_: _state.update(dump=True))
    _run = trio.run

    def run(*args, instruments=(), **kw):
        return _run(*args, instruments=(*instruments, _Prof()), **kw)

    trio.run = run
