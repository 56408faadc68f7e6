"""The console scripts' command lines: upstream's defaults (all interfaces, no metadata
server inside mooncake_master) and gflags' conventions (-v, --flagfile, --version).

What a script would exec is captured by replacing ``mooncake.cli._exec``, so defaults
that listen on all interfaces are checked without binding them; the scripts that do run
pin 127.0.0.1.
"""

import os
import subprocess
import sys

import pytest

from mooncake import cli


class Execed(Exception):
    """Raised by the stand-in for ``cli._exec``: what the script would have run."""

    def __init__(self, args):
        super().__init__(args)
        self.args_ = list(args)


@pytest.fixture
def execed(monkeypatch):
    """Runs a console-script function; returns the arguments it would exec."""
    def fake_exec(args):
        raise Execed(args)

    monkeypatch.setattr(cli, "_exec", fake_exec)
    monkeypatch.delenv("RUST_LOG", raising=False)

    def run(main, argv):
        with pytest.raises(Execed) as e:
            main(argv)
        return e.value.args_

    return run


def test_metadata_server_listens_on_all_interfaces_by_default(execed):
    args = execed(cli.http_metadata_server_main, [])
    assert args == ["metadata-server", "--port", "8080", "--bind", "0.0.0.0"]
    args = execed(cli.http_metadata_server_main, ["--port", "9000", "--host", "127.0.0.1"])
    assert args == ["metadata-server", "--port", "9000", "--bind", "127.0.0.1"]


@pytest.mark.parametrize("argv, level", [
    (["-v=1"], "debug"),
    (["--v=1"], "debug"),
    (["-v", "1"], "debug"),
    (["-v=2"], "trace"),
    (["--log-level", "WARNING"], "warn"),
    (["--log-level", "debug", "-v", "0"], "debug"),
])
def test_metadata_server_verbosity_sets_rust_log(execed, argv, level):
    execed(cli.http_metadata_server_main, argv)
    assert os.environ.get("RUST_LOG") == level


def test_metadata_server_without_verbosity_leaves_rust_log(execed):
    execed(cli.http_metadata_server_main, ["-v=0"])
    assert "RUST_LOG" not in os.environ


def test_metadata_server_reads_flagfiles_in_place(execed, tmp_path):
    inner = tmp_path / "inner.flags"
    inner.write_text("--host=127.0.0.1\n")
    outer = tmp_path / "outer.flags"
    outer.write_text("# ports\n\n--port=9100\n--flagfile=%s\n" % inner)
    args = execed(cli.http_metadata_server_main, ["--flagfile=%s" % outer])
    assert args == ["metadata-server", "--port", "9100", "--bind", "127.0.0.1"]
    # A later flag overrides the file's.
    args = execed(cli.http_metadata_server_main, ["-flagfile", str(outer), "--port", "9200"])
    assert args[:3] == ["metadata-server", "--port", "9200"]


@pytest.mark.parametrize("content, needle", [
    (None, "No such file"),
    ("mooncake_http_metadata_server\n--port=1\n", "line 1"),
    ("--flagfile=SELF\n", "nested"),
])
def test_bad_flagfiles_are_refused_by_name(execed, tmp_path, capsys, content, needle):
    path = tmp_path / "bad.flags"
    if content is not None:
        path.write_text(content.replace("SELF", str(path)))
    with pytest.raises(SystemExit) as e:
        cli.http_metadata_server_main(["--flagfile=%s" % path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--flagfile" in err and needle in err, err


def test_metadata_server_helpfull_and_version(execed, capsys):
    with pytest.raises(SystemExit) as e:
        cli.http_metadata_server_main(["--helpfull"])
    assert e.value.code == 0
    assert "--flagfile" in capsys.readouterr().out
    assert execed(cli.http_metadata_server_main, ["--version"]) == ["metadata-server", "--version"]


def test_master_passes_every_flag_through(execed):
    argv = ["--rpc_port=0", "-v", "1", "--flagfile=/x", "--version"]
    assert execed(cli.master_main, argv) == ["master"] + argv


def _script(main, argv, mooncake_bin, **kw):
    """Runs console-script function `main` (of mooncake.cli) in a child Python."""
    code = "from mooncake.cli import %s as m; m()" % main
    env = dict(os.environ, MOONCAKE_BIN=mooncake_bin)
    env.pop("RUST_LOG", None)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-c", code] + argv, env=env, text=True,
                            stdout=subprocess.PIPE, **kw)


@pytest.mark.parametrize("main, name", [
    ("master_main", "mooncake_master"),
    ("http_metadata_server_main", "mooncake_http_metadata_server"),
])
def test_version_prints_and_exits_zero(mooncake_bin, main, name):
    p = _script(main, ["--version"], mooncake_bin)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.startswith(name + " version "), out


def _ready_line_then_eof(start, tmp_path):
    """Starts a master with ``start(stdin=, stderr=)`` (it must take --until-stdin-eof),
    reads its ready line, closes its stdin and waits for it: (exit status, ready line,
    stderr). Stderr goes to a file: a pipe nobody reads meanwhile could fill."""
    with open(tmp_path / "stderr", "w+") as log:
        p = start(stdin=subprocess.PIPE, stderr=log)
        try:
            ready = p.stdout.readline()
            p.stdin.close()
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
        log.seek(0)
        return p.returncode, ready, log.read()


def test_mooncake_master_runs_no_metadata_server_by_default(mooncake_bin, tmp_path):
    argv = ["--rpc_address=127.0.0.1", "--port=0", "--metrics_port=off", "-v=1",
            "--max_threads=4", "--until-stdin-eof"]
    rc, ready, err = _ready_line_then_eof(
        lambda **kw: _script("master_main", argv, mooncake_bin, **kw), tmp_path)
    assert rc == 0, err
    assert ready.startswith("ready rpc=127.0.0.1:"), (ready, err)
    assert "metadata=" not in ready, ready
    # -v=1 is glog's verbosity: debug messages, such as the inert flag's, are shown.
    assert "--max_threads=4: accepted" in err, err


# Upstream's wheel keeps its programs in the package directory and scripts run them by
# that path; an installed wheel of ours has launchers there (a source checkout has not).
PACKAGE_DIR = os.path.dirname(os.path.abspath(cli.__file__))
needs_wheel_layout = pytest.mark.skipif(
    not os.path.exists(os.path.join(PACKAGE_DIR, "mooncake_master")),
    reason="the package is not an installed wheel (no launchers next to it)")


@needs_wheel_layout
def test_master_launcher_in_the_package_directory_serves(tmp_path):
    argv = [os.path.join(PACKAGE_DIR, "mooncake_master"), "--rpc_address=127.0.0.1",
            "--port=0", "--metrics_port=off", "--until-stdin-eof"]
    rc, ready, err = _ready_line_then_eof(
        lambda **kw: subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **kw), tmp_path)
    assert rc == 0, err
    assert ready.startswith("ready rpc=127.0.0.1:"), (ready, err)


@needs_wheel_layout
@pytest.mark.parametrize("name, usage", [
    ("mooncake_client", "usage: mooncake_client"),
    ("transfer_engine_bench", "transfer_engine_bench"),
])
def test_python_launchers_in_the_package_directory_run_their_module(name, usage):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([os.path.join(PACKAGE_DIR, name), "--help"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert usage in done.stdout + done.stderr
