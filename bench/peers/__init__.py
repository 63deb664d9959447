"""Peer job queues (arq, SAQ) doing W2's workload; run only from the bench-only venv.

`setup.sh` creates `.bench-venv` (arq, SAQ, hiredis, uvloop, aiohttp); bench/w2_poll.py
runs `<venv>/bin/python bench/peers/{arq,saq}_w2.py worker|enqueue ...` in child
processes. Nothing here is a dependency of asynctaskd or imported by it.
"""
