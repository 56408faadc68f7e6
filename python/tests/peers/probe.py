#!/usr/bin/env python3
"""A network observer on a simulated host (the multi-host tests): it sees the other
hosts as a real machine would, through its own namespace's interface. Standard library
only; it never imports mooncake.

Prints `ready <pid>`, then answers one command per stdin line with one line, `ok ...`
or `error ...`:
  reach HOST PORT SECONDS  a TCP connection to HOST:PORT succeeds within SECONDS -> `ok`
                           (tries paced by a short pause until the deadline)
  etcd-get ENDPOINT KEY    the value of KEY in the etcd at ENDPOINT (host:port), read
                           through etcd's v3 JSON gateway -> `ok VALUE`, or `ok` alone
                           when the key does not exist
Stdin EOF ends it.
"""

import base64
import json
import os
import socket
import sys
import time
import urllib.request

# Pacing between connection attempts; the answer is what synchronizes.
RETRY_PAUSE_S = 0.05


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def reach(host, port, seconds):
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return "ok"
        except OSError as e:
            if time.monotonic() > deadline:
                return "error %s:%d not reachable within %gs: %s" % (host, port, seconds, e)
        time.sleep(RETRY_PAUSE_S)


def etcd_get(endpoint, key):
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request("http://%s/v3/kv/range" % endpoint, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        kvs = json.load(resp).get("kvs", [])
    if not kvs:
        return "ok"
    return "ok " + base64.b64decode(kvs[0].get("value", "")).decode()


def answer(words):
    if words[0] == "reach" and len(words) == 4:
        return reach(words[1], int(words[2]), float(words[3]))
    if words[0] == "etcd-get" and len(words) == 3:
        return etcd_get(words[1], words[2])
    return "error usage: reach HOST PORT SECONDS | etcd-get ENDPOINT KEY"


def main():
    say("ready %d" % os.getpid())
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            say(answer(words))
        except Exception as e:  # one line per failure; the test decides
            say("error %s: %s" % (type(e).__name__, e))


if __name__ == "__main__":
    main()
