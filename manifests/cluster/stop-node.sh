#!/usr/bin/env bash
# Stops on this node what `ray stop` (and so `ray down`) leaves running: Serve's HAProxy
# processes, which outlive Ray draining with the HTTP port bound (found by the folder node-env.sh
# gave them, through prefixmesh.local_ray.stop_haproxy), and on the head the registry Redis
# start-redis.sh started on REDIS_PORT (by its pid file). Cloud nodes go away with `ray down`;
# machines you keep need it after `ray stop`:
#
#   bash stop-node.sh [REDIS_PORT [VENV]]
set -euo pipefail

port=${1:-}
venv=${2:-$HOME/prefixmesh-venv}

"$venv/bin/python" - "/tmp/pmh-$(id -u)-node" <<'EOF'
import sys
from pathlib import Path

from prefixmesh.local_ray import stop_haproxy

print(f"stopped HAProxy {stop_haproxy(Path(sys.argv[1]))}")
EOF

if [ -n "$port" ]; then
    pidfile=/tmp/prefixmesh-redis-$(id -u)-$port.pid
    if [ -s "$pidfile" ] && ps -p "$(cat "$pidfile")" -o args= | grep -q redis-server; then
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 50); do
            ps -p "$pid" -o stat= | grep -qv Z || break
            sleep 0.1
        done
        echo "stopped the registry Redis on port $port (pid $pid)"
    fi
fi
