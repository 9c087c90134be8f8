"""The frameworks' informational start-up lines stay off standard error (the toolkit's start-up
block comes first) unless the user asks for them; anything else written meanwhile passes."""

import os
import sys

import pytest

from adapters._common import quiet_start

ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = ("I0000 00:00:1795844585.791379   11585 port.cc:153] oneDNN custom operations are on. "
          "You may see slightly different numerical results.\n")


def test_the_loading_libraries_info_lines_are_dropped_and_the_rest_passes(capfd, monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with quiet_start():
        os.write(2, (ABSL + ONEDNN + "E0000 a real error\n" + ABSL + ONEDNN).encode())
    assert capfd.readouterr().err == "E0000 a real error\n"


def test_asked_for_with_level_0_they_pass(capfd, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    with quiet_start():
        os.write(2, (ABSL + ONEDNN).encode())
    assert capfd.readouterr().err == ABSL + ONEDNN


def test_an_import_error_inside_still_restores_standard_error(capfd, monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    with pytest.raises(ImportError), quiet_start():
        os.write(2, b"loading failed\n")
        raise ImportError("no such framework")
    print("after", file=sys.stderr)
    assert capfd.readouterr().err == "loading failed\nafter\n"


@pytest.mark.slow
def test_a_keras_example_starts_with_the_toolkits_block(launch):
    """TensorFlow 2.21 prints 'oneDNN custom operations are on' twice as it loads, even
    under TF_CPP_MIN_LOG_LEVEL=3; the example's output starts with the start-up block."""
    job = launch("python", 1, ["examples/bring_your_own/keras_cnn.py", "--steps", "1"],
                 timeout=300)
    assert job.returncode == 0, job
    assert "port.cc" not in job.stderr and "absl::InitializeLog" not in job.stderr, job.stderr
    assert job.stdout.startswith("backend     horovod-tf"), job.stdout
