"""horovodrun's launcher as the installer patches it (tools/patches/horovod-runner.patch)."""

import importlib.util
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "tools" / "patches" / "horovod-runner.patch"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                reason="Horovod is not installed here (tools/install.sh)")


def test_the_installed_launcher_carries_the_current_patch():
    """Taking the patch back would apply cleanly: every hunk is in the installed files."""
    site = sysconfig.get_paths()["purelib"]
    proc = subprocess.run(["patch", "-p1", "-R", "--dry-run", "-f", "-d", site],
                          input=PATCH.read_bytes(), capture_output=True)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_a_signal_while_the_event_is_being_set_does_not_wait_for_its_lock():
    """The hang: a first SIGINT's handler holds the event's lock inside Event.set() when a
    second signal runs the handler again in the same thread. Here the lock is held on purpose
    while the handler runs: it must return at once, and the event be set once it is free."""
    from horovod.runner.gloo_run import register_shutdown_event

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        event = register_shutdown_event()
        handler = signal.getsignal(signal.SIGINT)
        done = threading.Event()
        with event._cond:  # as Event.set() holds it when the first handler is interrupted
            caller = threading.Thread(target=lambda: (handler(signal.SIGINT, None),
                                                      handler(signal.SIGTERM, None),
                                                      done.set()), daemon=True)
            caller.start()
            assert done.wait(5), "the signal handler waited for the event's lock"
        assert event.wait(5) and event.signum == signal.SIGINT  # the first signal is kept
    finally:
        for signum, old in saved.items():
            signal.signal(signum, old)


def test_the_build_check_prints_nothing_and_asks_torch_first():
    """horovodrun's build check loads an extension in a forked process; what the framework
    writes to the file descriptors themselves (TensorFlow's start-up lines) goes nowhere."""
    code = ("from horovod.common import util; print('order', util._CHECK_ORDER); "
            "print('gloo', util.gloo_built(), 'mpi', util.mpi_built())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "0"},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["order ['torch', 'tensorflow', 'mxnet']",
                                        "gloo True mpi True"], proc.stdout
    assert proc.stderr == "", proc.stderr


def test_a_rank_that_ends_by_itself_keeps_its_status_however_slowly_its_shell_exits(tmp_path):
    """horovodrun runs each rank under ``sh -c`` and, when it stops the ranks, passes its signal
    on to the shell's children. A rank that checkpoints and exits with 130 must make horovodrun
    exit with 130, even when the shell has not yet exited at the moment its child ended (a
    loaded machine): it is given the grace time, not a SIGTERM that turns 130 into 143. The
    shell here waits a second after its child, which makes that moment long."""
    import io

    from horovod.runner.common.util import safe_shell_exec

    ready = tmp_path / "ready"
    child = ("import signal, sys, time, pathlib; "
             "signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); "
             f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    command = f"{sys.executable} -c \"{child}\"; status=$?; sleep 1; exit $status"
    stop = threading.Event()
    stop.signum = signal.SIGINT  # as horovodrun's shutdown event carries the signal it received

    def set_when_ready():
        for _ in range(600):
            if ready.exists():
                break
            threading.Event().wait(0.05)
        stop.set()

    threading.Thread(target=set_when_ready, daemon=True).start()
    out, err = io.StringIO(), io.StringIO()
    status = safe_shell_exec.execute(command, stdout=out, stderr=err, events=[stop])
    assert ready.exists()
    assert status == 130, (status, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("gone_at", [1, 2])
def test_a_shell_that_ends_while_its_children_are_listed_is_left_alone(monkeypatch, gone_at):
    """horovodrun stops the other ranks when one exits (a usage error: every rank exits 2 at
    once): a shell that ends between being found and its children being listed, at the
    first listing or at the wait's, is gone, not a traceback in horovodrun's thread."""
    import psutil
    from horovod.runner.common.util import safe_shell_exec

    shell = subprocess.Popen(["sleep", "30"])
    calls, children = [], psutil.Process.children

    def vanishing(self, *args, **kwargs):
        calls.append(self.pid)
        if len(calls) == gone_at:
            raise psutil.NoSuchProcess(self.pid)
        return children(self, *args, **kwargs)

    monkeypatch.setattr(psutil.Process, "children", vanishing)
    try:
        safe_shell_exec.terminate_executor_shell_and_children(shell.pid)
        assert calls[:gone_at] == [shell.pid] * gone_at
    finally:
        shell.kill()
        shell.wait()
