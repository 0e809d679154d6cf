"""What the command-line tests share: one call of ``quantscope``'s main, its output read."""

from quantscope import cli


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``cli.main(argv)``: its exit code, stdout and stderr (pytest's ``capsys``)."""
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err
