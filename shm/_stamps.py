import os, time
S = []
def mark(*v):
    S.append(v)
    if len(S) >= 20000:
        with open(f"/tmp/stamps.{os.getpid()}", "a") as f:
            for x in S: f.write(" ".join(map(str, x)) + "\n")
        S.clear()
now = time.monotonic_ns
