#!/usr/bin/env bash
# Bench-only venv with the peer job queues (arq, SAQ). NOT project dependencies: nothing
# in asynctaskd imports them; bench/w2_poll.py and bench/w1_peers.py run their workers from it.
#   bash bench/peers/setup.sh            # creates .bench-venv at the repo root
#   BENCH_VENV=/somewhere bash bench/peers/setup.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${BENCH_VENV:-$root/.bench-venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
# Pinned to the versions the issue's peer table was measured with; hiredis and uvloop so
# each peer runs with the same fast paths asynctaskd gets; aiohttp is the peers' vendor client.
"$venv/bin/python" -m pip install --quiet \
    "arq==0.28.*" "saq[hiredis]==0.26.*" hiredis uvloop aiohttp
"$venv/bin/python" -c "import arq, saq; print('arq', arq.VERSION, 'saq', saq.__version__)"
