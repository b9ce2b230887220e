#!/usr/bin/env python3
"""Slow readers of large answers (docs/reliability.md, "Hostile clients").

A `tidemark serve` of its own (auth off, a temporary data folder) receives 1,000 inbox records of
about 60 KB each; then N connections each ask for the whole page
(`GET /v1/consumers/log/inbox?limit=1000`) with a 4 KiB receive buffer and never read it. The
server's resident memory is sampled for 10 s; a health request is timed at the end.

    python3 docs/experiments/slow_readers.py target/release/tidemark 30 [port] ["<extra TOML>"]
"""
import json, socket, subprocess, sys, tempfile, time, urllib.request

binary, readers = sys.argv[1], int(sys.argv[2])
port = int(sys.argv[3]) if len(sys.argv) > 3 else 7811
extra = sys.argv[4] if len(sys.argv) > 4 else ""
base = f"http://127.0.0.1:{port}"
folder = tempfile.mkdtemp(prefix="slow-readers-")
config = f"{folder}/serve.toml"
with open(config, "w") as f:
    f.write(f'listen = "127.0.0.1:{port}"\ndata_dir = "{folder}/data"\n[auth]\nmode = "none"\n{extra}\n')
server = subprocess.Popen([binary, "serve", "--config", config], stdout=subprocess.DEVNULL,
                          stderr=open(f"{folder}/serve.log", "w"))


def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, method=method, data=data,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status, answer.read()


def rss_kib():
    for line in open(f"/proc/{server.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])


try:
    for _ in range(100):
        try:
            call("GET", "/healthz")
            break
        except OSError:
            time.sleep(0.1)
    call("PUT", "/v1/consumers/log", {"handler": "record"})
    now = int(time.time() * 1000)
    text = "x" * 60_000
    for first in range(0, 1000, 3):
        events = [{"event_id": f"e{i}", "source": "exp", "generation": "g1", "flow_id": f"f{i}", "seq": 1,
                   "event_type": "note.added", "schema_version": 1, "payload": {"text": text},
                   "created_at_ms": now} for i in range(first, min(first + 3, 1000))]
        call("POST", "/v1/consumers/log/inbox/batch", {"events": events})
    _, page = call("GET", "/v1/consumers/log/inbox?limit=1000")
    page_json = json.loads(page)
    print(f"one page: {len(page)} bytes, {len(page_json['records'])} records, truncated: {page_json.get('truncated')}")
    time.sleep(1)
    before = rss_kib()
    sockets = []
    for _ in range(readers):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /v1/consumers/log/inbox?limit=1000 HTTP/1.1\r\nHost: x\r\n\r\n")
        sockets.append(s)
    peak = before
    for _ in range(20):
        time.sleep(0.5)
        peak = max(peak, rss_kib())
    started = time.time()
    call("GET", "/healthz")
    probe_ms = (time.time() - started) * 1000
    print(f"{readers} slow readers: resident {before / 1024:.1f} MiB before, {peak / 1024:.1f} MiB at most "
          f"(+{(peak - before) / 1024 / readers:.1f} MiB a reader); a health request {probe_ms:.1f} ms")
    for s in sockets:
        s.close()
finally:
    server.terminate()
    server.wait()
    subprocess.run(["rm", "-rf", folder])
