"""``shmserve-analyzer``: model-analyzer's job for shmserve.

One configuration's path, file by file: ``cli.py`` reads the flags and runs the search of
``space.py`` (brute force, or quick hill climbing); ``configs.py`` writes a candidate's
config.pbtxt into a temporary repository; ``runner.py`` serves it, measures it with shmserve-perf
(``shmserve.tools.perf``) and scores it against the goal; ``report.py`` writes the report folder.
"""
