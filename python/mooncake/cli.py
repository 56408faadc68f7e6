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
    """``mooncake_master ARGS...``: ``mooncake master ARGS...``, which takes every upstream
    mooncake_master flag in gflags syntax and upstream's defaults: all interfaces, no
    embedded metadata server unless ``--enable_http_metadata_server``."""
    _exec(["master"] + list(sys.argv[1:] if argv is None else argv))


_LOG_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error",
               "CRITICAL": "error"}

# Flag files may name further flag files this deep.
_FLAGFILE_DEPTH = 8


def _flagfile_lines(path):
    """The ``--flag=value`` lines of a gflags flag file (blank lines and ``#`` comments
    skipped); ValueError naming the file and line for anything else."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError("--flagfile %s: %s" % (path, e.strerror or e)) from None
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("-"):
            raise ValueError("--flagfile %s line %d: %r: only --flag=value lines are supported"
                             % (path, n, line))
        lines.append(line)
    return lines


def _expand_flagfiles(argv, depth=_FLAGFILE_DEPTH):
    """gflags' ``--flagfile=PATH`` (also ``-flagfile PATH``): the file's lines stand where
    it was named."""
    out = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name != "flagfile":
            out.append(arg)
            continue
        path = value if eq else next(args, None)
        if not path:
            raise ValueError("--flagfile needs a path")
        if depth == 0:
            raise ValueError("--flagfile %s: flag files nested more than %d deep"
                             % (path, _FLAGFILE_DEPTH))
        out.extend(_expand_flagfiles(_flagfile_lines(path), depth - 1))
    return out


def _rust_log(verbosity, log_level):
    """The RUST_LOG value for glog's ``-v`` (1: debug, 2 and more: trace) or upstream's
    ``--log-level``; None to leave the environment as it is."""
    if verbosity is not None and verbosity >= 2:
        return "trace"
    if verbosity == 1:
        return "debug"
    if log_level:
        return _LOG_LEVELS[log_level]
    return None


def http_metadata_server_main(argv=None):
    """``mooncake_http_metadata_server [--port 8080] [--host 0.0.0.0] [--log-level L]``
    (upstream's flags; also ``-v N``, ``--flagfile PATH``, ``--version``):
    ``mooncake metadata-server --port N --bind IP``, on all interfaces by default."""
    parser = argparse.ArgumentParser(
        prog="mooncake_http_metadata_server",
        description="Mooncake HTTP metadata server (REST on /metadata).")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (8080)")
    parser.add_argument("--host", "--addr", "--bind", dest="host", default="0.0.0.0",
                        help="address to bind (0.0.0.0: all interfaces)")
    parser.add_argument("--log-level", type=str.upper, choices=sorted(_LOG_LEVELS),
                        default=None, help="logging level")
    parser.add_argument("-v", "--v", dest="verbosity", type=int, default=None,
                        help="glog verbosity: 1 logs debug messages, 2 and more trace")
    parser.add_argument("--flagfile", metavar="PATH",
                        help="a file of --flag=value lines, read in its place")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--helpfull", action="help", help="the same as --help")
    try:
        raw = _expand_flagfiles(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(raw)
    if args.version:
        _exec(["metadata-server", "--version"])
    host = args.host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = socket.gethostbyname(host)
        except OSError as e:
            parser.error(f"--host {args.host!r}: {e}")
    rust_log = _rust_log(args.verbosity, args.log_level)
    if rust_log:
        os.environ["RUST_LOG"] = rust_log
    _exec(["metadata-server", "--port", str(args.port), "--bind", host])


if __name__ == "__main__":
    main()
