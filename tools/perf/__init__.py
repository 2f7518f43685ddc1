"""``shmserve-perf``: perf_analyzer's job for any KServe v2 server (HTTP, gRPC) and for shmserve's
local client.

One request's path through the tool, file by file:

- ``cli.py`` reads the flags (perf_analyzer's names) into a ``plan.Plan``;
- ``describe.py`` asks the server for the model's metadata and config, and ``inputs.py`` turns them
  (with ``-b``, ``--shape`` and ``--input-data``) into the tensors every request carries;
- ``pool.py`` starts the client processes; each runs ``slots.py``'s loops (closed for
  ``--concurrency-range``, on a schedule for ``--request-rate-range``), which call one of
  ``http_caller.py``, ``grpc_caller.py`` or ``local_caller.py`` and record when each answer came;
- ``measure.py`` cuts the records into measurement windows until three agree
  (``--stability-percentage``), with the server's own statistics (``server_stats.py``) read at
  every window's edges; ``windows.py`` does the arithmetic;
- ``compare.py`` is ``--compare``: the same plan against several servers in A B B A slices;
- ``report.py`` prints perf_analyzer's summary and writes ``-f`` CSV and ``--profile-export-file``;
  ``plot.py`` draws ``--plot``; ``progress.py`` is the live line on stderr.
"""
