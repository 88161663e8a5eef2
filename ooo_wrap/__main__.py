"""``python -m ooo_wrap``: the command line (see ``ooo_wrap._cli``)."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m ooo_wrap"))
