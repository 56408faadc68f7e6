"""In-tree PEP 517 build backend for the ``mooncake`` Python package (standard library only).

Why not setuptools/maturin: the binding is pure Python over ctypes, so the only native
artefacts are what cargo already builds (``libmooncake.so`` and the ``mooncake`` binary);
a wheel is a zip of those plus the Python files, which zipfile/hashlib/base64 write
directly. No build dependency has to be fetched from PyPI (``requires = []``), so
``pip install ./python`` works offline, and there is no pyo3 or C++ to compile.

What ``build_wheel`` does:
  1. Gets ``libmooncake.so`` and ``mooncake``: from ``$MOONCAKE_PREBUILT_DIR`` when set
     (a directory holding both), else by running
     ``cargo build --release --manifest-path <checkout>/Cargo.toml -p mooncake --lib --bin mooncake``
     (output under ``$CARGO_TARGET_DIR`` when set, else ``<checkout>/target``).
  2. Writes ``mooncake-<version>-py3-none-<platform>.whl`` holding ``mooncake/*.py``,
     ``mooncake/libmooncake.so``, ``mooncake/bin/mooncake``, the launchers upstream's
     wheel keeps in the package (``LAUNCHERS``: ``mooncake/mooncake_master``, ...), a generated
     ``mooncake/_version.py`` and the .dist-info (METADATA, WHEEL, entry_points.txt,
     top_level.txt, RECORD).

Config settings (``pip wheel ./python -C strip=false``): ``strip`` (default "true":
debug symbols are stripped from the copies put in the wheel, when ``strip`` is
installed, so the wheel is a few MB; "false" keeps them, for debugging).
"""

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile

NAME = "mooncake-transfer-engine"
DIST = "mooncake_transfer_engine"
SUMMARY = ("Mooncake-compatible KV-cache transfer engine and distributed store "
           "(Rust implementation; Python API of Mooncake's mooncake package)")
REQUIRES_PYTHON = ">=3.8"
LICENSE = "Apache-2.0"

ENTRY_POINTS = """\
[console_scripts]
mooncake = mooncake.cli:main
mooncake_master = mooncake.cli:master_main
mooncake_http_metadata_server = mooncake.cli:http_metadata_server_main
mooncake_client = mooncake.real_client:main
mc_store_rest_server = mooncake.mooncake_store_service:sync_main
transfer_engine_bench = mooncake.cli_bench:main
transfer_engine_topology_dump = mooncake.transfer_engine_topology_dump:main
"""

# Upstream's wheel also ships its programs inside the package directory, and scripts run
# them by that path (os.path.dirname(mooncake.__file__) + "/mooncake_master"). These
# launchers stand there: the master is the bundled binary; the other two are Python
# modules, run by the interpreter of the environment the package is installed in (else
# python3) with the package's site directory on PYTHONPATH.
_LAUNCHER_HEAD = """\
#!/bin/sh
# Installed by the mooncake package where upstream's wheel keeps this program.
pkg=$(dirname "$(readlink -f "$0")")
"""
_PYTHON_LAUNCHER = _LAUNCHER_HEAD + """\
site=$(dirname "$pkg")
py="$site/../../../bin/python"
[ -x "$py" ] || py=python3
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m %s "$@"
"""
LAUNCHERS = {
    "mooncake_master": _LAUNCHER_HEAD + 'exec "$pkg/bin/mooncake" master "$@"\n',
    "mooncake_client": _PYTHON_LAUNCHER % "mooncake.real_client",
    "transfer_engine_bench": _PYTHON_LAUNCHER % "mooncake.cli_bench",
}

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT = os.path.dirname(PYTHON_DIR)
PACKAGE_DIR = os.path.join(PYTHON_DIR, "mooncake")


def _log(msg):
    print(f"mooncake build: {msg}", file=sys.stderr, flush=True)


def _version():
    cargo = os.path.join(CHECKOUT, "Cargo.toml")
    try:
        with open(cargo, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "0.0.0"
    package = re.search(r"^\[package\](.*?)(?=^\[|\Z)", text, re.M | re.S)
    m = re.search(r'^version\s*=\s*"([^"]+)"', package.group(1) if package else text, re.M)
    return m.group(1) if m else "0.0.0"


def _platform_tag():
    plat = sysconfig.get_platform()  # e.g. linux-x86_64
    return re.sub(r"[^A-Za-z0-9_]", "_", plat)


def _tag():
    return f"py3-none-{_platform_tag()}"


def _metadata(version):
    return (
        "Metadata-Version: 2.1\n"
        f"Name: {NAME}\n"
        f"Version: {version}\n"
        f"Summary: {SUMMARY}\n"
        f"License: {LICENSE}\n"
        f"Requires-Python: {REQUIRES_PYTHON}\n"
        "Classifier: Programming Language :: Python :: 3\n"
        "Classifier: Operating System :: POSIX :: Linux\n"
        "Provides-Extra: torch\n"
        "Requires-Dist: torch; extra == \"torch\"\n"
        "\n"
        "Python package `mooncake` (modules mooncake.engine and mooncake.store) over\n"
        "libmooncake.so, with the mooncake, mooncake_master and\n"
        "mooncake_http_metadata_server commands.\n"
    )


def _wheel_file():
    return ("Wheel-Version: 1.0\n"
            "Generator: mooncake_build (in-tree)\n"
            "Root-Is-Purelib: false\n"
            f"Tag: {_tag()}\n")


def _dist_info_files(version):
    return {
        "METADATA": _metadata(version),
        "WHEEL": _wheel_file(),
        "entry_points.txt": ENTRY_POINTS,
        "top_level.txt": "mooncake\n",
    }


# ---------------------------------------------------------------- PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    version = _version()
    dist_info = f"{DIST}-{version}.dist-info"
    path = os.path.join(metadata_directory, dist_info)
    os.makedirs(path, exist_ok=True)
    for name, text in _dist_info_files(version).items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)
    return dist_info


def build_sdist(sdist_directory, config_settings=None):
    raise NotImplementedError(
        "mooncake: no sdist (the wheel needs the whole Rust checkout); build a wheel from "
        "a checkout instead: `pip wheel ./python` or `pip install ./python`")


def _find_cargo():
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        home = os.path.expanduser("~/.cargo/bin/cargo")
        cargo = home if os.path.exists(home) else None
    return cargo


def _build_native():
    """(library path, binary path), built by cargo or taken from MOONCAKE_PREBUILT_DIR."""
    prebuilt = os.environ.get("MOONCAKE_PREBUILT_DIR")
    if prebuilt:
        lib = os.path.join(prebuilt, "libmooncake.so")
        binary = os.path.join(prebuilt, "mooncake")
        missing = [p for p in (lib, binary) if not os.path.isfile(p)]
        if missing:
            raise RuntimeError(f"MOONCAKE_PREBUILT_DIR={prebuilt}: missing {', '.join(missing)}")
        _log(f"using prebuilt {lib} and {binary}")
        return lib, binary
    manifest = os.path.join(CHECKOUT, "Cargo.toml")
    if not os.path.isfile(manifest):
        raise RuntimeError(
            f"{manifest} not found: build from a checkout (pip >= 21.3 builds in place), or "
            "set MOONCAKE_PREBUILT_DIR to a directory with libmooncake.so and mooncake")
    cargo = _find_cargo()
    if not cargo:
        raise RuntimeError(
            "cargo not found (install a Rust toolchain, https://rustup.rs), or set "
            "MOONCAKE_PREBUILT_DIR to a directory with libmooncake.so and mooncake")
    target_dir = os.environ.get("CARGO_TARGET_DIR") or os.path.join(CHECKOUT, "target")
    if not os.path.isabs(target_dir):
        target_dir = os.path.join(CHECKOUT, target_dir)
    cmd = [cargo, "build", "--release", "--manifest-path", manifest, "-p", "mooncake", "--lib", "--bin", "mooncake"]
    _log(" ".join(cmd) + f"  (target dir {target_dir})")
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir)
    # cargo's progress goes to stderr, which pip shows with -v.
    subprocess.run(cmd, check=True, env=env, cwd=CHECKOUT, stdout=sys.stderr)
    out = os.path.join(target_dir, "release")
    return os.path.join(out, "libmooncake.so"), os.path.join(out, "mooncake")


def _maybe_strip(path, config_settings, tmp):
    want = str((config_settings or {}).get("strip", "true")).lower() in ("1", "true", "yes")
    strip = shutil.which("strip")
    if not want or not strip:
        return path
    copy = os.path.join(tmp, os.path.basename(path))
    shutil.copy2(path, copy)
    subprocess.run([strip, "--strip-debug", copy], check=True)
    return copy


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _zip_time():
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))  # 1980-01-01
    return time.gmtime(max(epoch, 315532800))[:6]


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    lib, binary = _build_native()
    files = []  # (arcname, bytes, mode)
    for root, dirs, names in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "bin"))
        for name in sorted(names):
            if not name.endswith(".py") or name == "_version.py":
                continue
            path = os.path.join(root, name)
            arc = os.path.relpath(path, PYTHON_DIR).replace(os.sep, "/")
            with open(path, "rb") as f:
                files.append((arc, f.read(), 0o644))
    files.append(("mooncake/_version.py", f'__version__ = "{version}"\n'.encode(), 0o644))
    for name, text in LAUNCHERS.items():
        files.append((f"mooncake/{name}", text.encode(), 0o755))
    with tempfile.TemporaryDirectory() as tmp:
        for src, arc in ((lib, "mooncake/libmooncake.so"), (binary, "mooncake/bin/mooncake")):
            src = _maybe_strip(src, config_settings, tmp)
            with open(src, "rb") as f:
                files.append((arc, f.read(), 0o755))
    dist_info = f"{DIST}-{version}.dist-info"
    for name, text in _dist_info_files(version).items():
        files.append((f"{dist_info}/{name}", text.encode(), 0o644))

    wheel_name = f"{DIST}-{version}-{_tag()}.whl"
    os.makedirs(wheel_directory, exist_ok=True)
    path = os.path.join(wheel_directory, wheel_name)
    stamp = _zip_time()
    record = []
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, data, mode in files:
            info = zipfile.ZipInfo(arc, date_time=stamp)
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            record.append(_record_line(arc, data))
        record_name = f"{dist_info}/RECORD"
        record.append(f"{record_name},,")
        info = zipfile.ZipInfo(record_name, date_time=stamp)
        info.external_attr = (0o100000 | 0o644) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, "\n".join(record) + "\n")
    _log(f"wrote {path}")
    return wheel_name
