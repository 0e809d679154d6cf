"""csrc/qs_threads.h's ``qs_run_jobs``: the caller and the threads it starts claim the jobs,
so each job runs exactly once whoever takes it, a job's error reaches the caller, and the
caller returns only after every job has finished (its writes seen), even after a wake-up with
no signal; the caller works its share (it runs every job when no thread starts) and threads = n
starts n - 1 threads. Built as programs here, the claim test also under ThreadSanitizer where
the compiler has it (a data race or a use of the freed shared block fails the run)."""

import subprocess
from pathlib import Path

import pytest
from march_builds import CC

from quantscope import kernels

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")

PROGRAM = Path(__file__).with_name("csrc") / "threads_claim_test.c"
CONTRACT = Path(__file__).with_name("csrc") / "threads_contract_test.c"


def _build(tmp_path, flags, program=PROGRAM):
    exe = tmp_path / "claim"
    done = subprocess.run([CC, "-O1", "-g", "-pthread", *flags, f"-I{kernels.CSRC}",
                           str(program), "-o", str(exe)], check=False, capture_output=True,
                          text=True)
    return exe if done.returncode == 0 else None


@pytest.mark.parametrize("flags", [[], ["-fsanitize=thread"]], ids=["plain", "tsan"])
def test_every_job_runs_once_and_its_error_reaches_the_caller(tmp_path, flags):
    exe = _build(tmp_path, flags)
    if exe is None:
        pytest.skip(f"the compiler cannot build with {flags}")
    run = subprocess.run([str(exe)], check=False, capture_output=True, text=True,
                         timeout=120)
    if flags and run.returncode != 0 and "FATAL: ThreadSanitizer" in run.stderr:
        pytest.skip("ThreadSanitizer cannot run here (memory layout)")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-2000:]


@pytest.mark.parametrize("flag", ["SPURIOUS", "FAILING_CREATE", "CONCURRENT"])
def test_the_caller_waits_for_all_works_its_share_and_starts_threads_minus_one(tmp_path, flag):
    """SPURIOUS: a wake-up with no signal does not return the caller early (it waits in a loop);
    FAILING_CREATE: no thread starts, the caller runs every job (it claims jobs, not only
    waits); CONCURRENT: threads = 2 runs the two jobs side by side (one thread is started)."""
    exe = _build(tmp_path, [f"-D{flag}"], CONTRACT)
    assert exe is not None
    try:
        run = subprocess.run([str(exe)], check=False, capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{flag}: qs_run_jobs never returned (the caller waits for jobs nobody runs)")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-2000:]
