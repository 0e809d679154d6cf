"""`make bench`: run every bench/bench_*.py (each has main()), or those named on the command line.

    python bench/run.py            # all
    python bench/run.py minmax mse # bench_minmax.py and bench_mse.py
    python bench/run.py gpu        # bench/gpu_triton.py (a device run; not in the default list)

Each bench's output goes to the terminal and, under a header of the run (date, machine and
the kernels' ISA, load average, threads, versions), to ``bench/results/<name>.txt``
(``--results DIR`` elsewhere); `make bench-docs` (bench/results_page.py) renders
docs/benchmarks.md from those files. A device bench run without CUDA prints its skip and
keeps the saved result of the last device run (it is not run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_page import format_result  # bench/ is on the path from here on

#: benches outside the bench_*.py pattern, run only when named
EXTRA = {"gpu": "gpu_triton"}
#: benches that measure a CUDA device: without one their result file is left as it is
DEVICE = {"gpu", "cuda"}
#: CPU flags the C kernels' branches depend on (kernels/csrc: AVX2, AVX-512; ORT's int8: VNNI)
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")
PACKAGES = ("transformers", "compressed-tensors", "torchao", "onnxruntime", "triton",
            "llmcompressor")  # the last two: on a device run, from its wheelhouse
PEER_PACKAGES = ("llmcompressor", "amd-quark", "nvidia-modelopt", "compressed-tensors")


def cpu_info() -> tuple[str, list[str]]:
    """(CPU model name with its family / model numbers, the ISA flags of ISA_FLAGS it has)
    from /proc/cpuinfo: the same name covers several generations ("AMD EPYC")."""
    fields, flags = {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "flags":
                flags = set(value.split())
                break  # the first processor's block is enough
            fields.setdefault(key, value)
    except OSError:
        pass
    model = fields.get("model name", platform.processor() or platform.machine())
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    return model, [f for f in ISA_FLAGS if f in flags]


def machine() -> str:
    model, isa = cpu_info()
    device = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{model}, {os.cpu_count()} cores, {platform.machine()}; ISA "
            f"{' '.join(isa) or 'none of ' + '/'.join(ISA_FLAGS[:2])}{device}")


def _versions(packages) -> dict[str, str]:
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def peer_versions() -> dict[str, str]:
    """The peers' packages in QUANTSCOPE_PEER_PYTHON's environment, else ``.peers``' (where
    the benches look for it), {} without one."""
    python = os.environ.get("QUANTSCOPE_PEER_PYTHON") or str(HERE.parent / ".peers" / "bin" / "python")
    if not os.path.exists(python):
        return {}
    code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); from run import _versions; "
            f"print(json.dumps(_versions({list(PEER_PACKAGES)!r})))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                             check=True, env={**os.environ, "PYTHONPATH": ""}).stdout
        return json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def git_rev() -> str:
    def git(*args):
        try:  # a device image may have no git
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True,
                                  check=False).stdout
        except OSError:
            return ""
    rev = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "bench").strip()
    return rev + (" with local changes" if dirty else "")


def versions(rev: str) -> str:
    import quantscope

    ours = {"python": platform.python_version(), "torch": torch.__version__,
            "quantscope": f"{quantscope.__version__} (git {rev})", **_versions(PACKAGES)}
    peers = peer_versions()
    text = ", ".join(f"{k} {v}" for k, v in ours.items())
    return text + ("; peers' venv: " + ", ".join(f"{k} {v}" for k, v in peers.items())
                   if peers else "; no peers' venv")


@contextmanager
def tee_stdout(sink: list[bytes]):
    """Copy file descriptor 1 into ``sink`` while it still reaches the terminal: the benches'
    child processes (the peers' python, torchrun workers) write to it directly."""
    sys.stdout.flush()
    terminal = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump():
        while chunk := os.read(read_end, 1 << 16):
            os.write(terminal, chunk)
            sink.append(chunk)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    saved, sys.stdout = sys.stdout, open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = saved  # print() reached fd 1 even where sys.stdout was another stream
        os.dup2(terminal, 1)  # the pipe's last write end closes: the pump reads EOF
        thread.join()
        os.close(read_end)
        os.close(terminal)


def run_one(name: str, common: dict[str, str], results: Path) -> None:
    if name in DEVICE and not torch.cuda.is_available():
        print(f"(no CUDA device: skipped; {results / name}.txt left as it is)\n", flush=True)
        return
    module = importlib.import_module(EXTRA.get(name, f"bench_{name}"))
    start, load0, sink = time.time(), os.getloadavg()[0], []
    argv, sys.argv = sys.argv, [module.__file__]  # a bench's own argparse sees no arguments
    threads = torch.get_num_threads()  # a bench that pins its own leaves the next one alone
    try:
        with tee_stdout(sink):
            module.main()
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    seconds = time.time() - start
    versions_run, end_rev = common["versions"], git_rev()
    if end_rev != common["rev"]:  # the checkout changed under the bench (children import it anew)
        versions_run = versions_run.replace(f"(git {common['rev']})",
                                            f"(git {common['rev']} at the start, {end_rev} at the end)")
    minutes, secs = divmod(round(seconds), 60)
    header = {"date": f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, "
                      f"{minutes} min {secs} s",
              "command": f"python bench/run.py {name}",
              "load": f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
                      "(1-minute load average)",
              "machine": common["machine"], "threads": common["threads"], "versions": versions_run}
    results.mkdir(parents=True, exist_ok=True)
    body = b"".join(sink).decode(errors="replace")
    (results / f"{name}.txt").write_text(format_result(name, header, body))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="benches to run (default: every bench_*.py)")
    p.add_argument("--results", default=str(HERE / "results"), help="where the results go")
    args = p.parse_args(argv)
    names = args.names or sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))
    unknown = [n for n in names if n not in EXTRA and not (HERE / f"bench_{n}.py").is_file()]
    if unknown:
        raise SystemExit(f"run.py: no bench named {unknown}: expected bench/bench_<name>.py "
                         f"or one of {sorted(EXTRA)}")
    rev = git_rev()
    common = {"machine": machine(), "threads": f"{torch.get_num_threads()} (torch's, at the "
              "start; a bench may pin its own)", "versions": versions(rev), "rev": rev}
    print(f"# quantscope benchmarks, {time.strftime('%Y-%m-%d')}: {common['machine']}, "
          f"{common['threads']}, {common['versions']}\n", flush=True)
    for name in names:
        print(f"## {name}\n", flush=True)
        run_one(name, common, Path(args.results))


if __name__ == "__main__":
    main(sys.argv[1:])
