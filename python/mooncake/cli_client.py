"""``python -m mooncake.cli_client``: upstream's module name for the ``mooncake_client``
command (a real store client serving dummy clients; see ``mooncake.real_client``)."""

import sys


def main(argv=None):
    from .real_client import main as real_client_main

    return real_client_main(argv)


if __name__ == "__main__":
    sys.exit(main())
