"""Console scripts: ``mooncake``, ``mooncake_master``, ``mooncake_http_metadata_server``.

Each replaces itself (os.execv) with the bundled ``mooncake`` binary, so signals and the
exit status belong to the real process.

Where the binary is looked for: ``bin/mooncake`` inside this package (what a wheel
installs), else the environment variable ``MOONCAKE_BIN``, else ``mooncake`` next to the
library named by ``MOONCAKE_LIB`` (a cargo target directory). PATH is not searched: the
console script itself is called ``mooncake``.
"""

import argparse
import ipaddress
import os
import socket
import sys

__all__ = ["binary_path", "main", "master_main", "http_metadata_server_main"]


def binary_path():
    """The path of the ``mooncake`` binary; FileNotFoundError naming what was tried."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [("bundled", os.path.join(here, "bin", "mooncake"))]
    if os.environ.get("MOONCAKE_BIN"):
        candidates.append(("MOONCAKE_BIN", os.environ["MOONCAKE_BIN"]))
    if os.environ.get("MOONCAKE_LIB"):
        lib_dir = os.path.dirname(os.path.abspath(os.environ["MOONCAKE_LIB"]))
        candidates.append(("next to MOONCAKE_LIB", os.path.join(lib_dir, "mooncake")))
    for _, path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "mooncake: the mooncake binary was not found; tried "
        + ", ".join(f"{p} ({why})" for why, p in candidates)
        + ". Install with `pip install ./python` or set MOONCAKE_BIN.")


def _exec(args):
    try:
        path = binary_path()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        sys.exit(127)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [path] + list(args))


def main(argv=None):
    """``mooncake ARGS...``: the bundled binary with the same arguments."""
    _exec(sys.argv[1:] if argv is None else argv)


def master_main(argv=None):
    """``mooncake_master ARGS...``: ``mooncake master ARGS...`` (every upstream
    mooncake_master flag is passed through unchanged)."""
    _exec(["master"] + list(sys.argv[1:] if argv is None else argv))


_LOG_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error",
               "CRITICAL": "error"}


def http_metadata_server_main(argv=None):
    """``mooncake_http_metadata_server [--port 8080] [--host 0.0.0.0] [--log-level L]``
    (upstream's flags): ``mooncake metadata-server --port N --bind IP``."""
    parser = argparse.ArgumentParser(
        prog="mooncake_http_metadata_server",
        description="Mooncake HTTP metadata server (REST on /metadata).")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (8080)")
    parser.add_argument("--host", "--addr", "--bind", dest="host", default="0.0.0.0",
                        help="address to bind (0.0.0.0)")
    parser.add_argument("--log-level", type=str.upper, choices=sorted(_LOG_LEVELS),
                        default=None, help="logging level")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    host = args.host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = socket.gethostbyname(host)
        except OSError as e:
            parser.error(f"--host {args.host!r}: {e}")
    if args.log_level:
        os.environ["RUST_LOG"] = _LOG_LEVELS[args.log_level]
    _exec(["metadata-server", "--port", str(args.port), "--bind", host])


if __name__ == "__main__":
    main()
