"""``python -m quantscope.kernels``: build every C kernel now (into the per-user cache) and
say which are in use; exit status 1 if any could not be built."""

import argparse
import sys

from . import build_all, cache_dir, compiler, disabled


def main(argv=None) -> int:
    # no options: the parser gives --help, and refuses arguments rather than ignore them
    argparse.ArgumentParser(
        prog="python -m quantscope.kernels",
        description="Build every C kernel now, into the per-user cache ($QUANTSCOPE_CACHE, "
        "else $XDG_CACHE_HOME/quantscope), with $CC (else cc or gcc), and say which are in "
        "use; exit status 1 if any could not be built.").parse_args(argv)
    if disabled():
        print("QUANTSCOPE_NO_KERNEL is set: every kernel is off (torch path)")
        return 0
    built = build_all()
    try:
        cc = compiler()
        found = " ".join(cc) if cc else "none"
    except FileNotFoundError as e:
        found = f"none: {e}"
    print(f"compiler: {found}; cache: {cache_dir()}")
    for name, ok in built.items():
        print(f"  {name:12s} {'built' if ok else 'NOT built (torch path)'}")
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
