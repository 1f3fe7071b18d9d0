#!/usr/bin/env bash
# Starts the cluster's registry Redis on the head, as node-env.sh described it: bound to the
# host of $PREFIXMESH_REDIS_URL (the head's address, for the other nodes) and to 127.0.0.1, on
# its port, with `requirepass` $PREFIXMESH_REDIS_PASSWORD. The password goes in on stdin, never
# on the command line (`ps` would show it). A Redis this script started before on that port is
# shut down first, so a second `ray up` starts a fresh one. No persistence: the registry is
# advisory and rebuilt from the replicas' events.
#
#   . node-env.sh HEAD_IP REDIS_PORT SERVE_CONFIG && bash start-redis.sh
set -euo pipefail

url=${PREFIXMESH_REDIS_URL:?start-redis.sh: source node-env.sh first}
: "${PREFIXMESH_REDIS_PASSWORD:?start-redis.sh: source node-env.sh first}"
address=${url#redis://}
address=${address%%/*}
host=${address%:*}
port=${address##*:}
run=/tmp/prefixmesh-redis-$(id -u)-$port

REDISCLI_AUTH=$PREFIXMESH_REDIS_PASSWORD redis-cli -h 127.0.0.1 -p "$port" shutdown nosave \
    >/dev/null 2>&1 || true
for _ in $(seq 50); do  # until the old one has let go of the port
    REDISCLI_AUTH=$PREFIXMESH_REDIS_PASSWORD redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null |
        grep -q PONG || break
    sleep 0.1
done
binds="$host"
[ "$host" = 127.0.0.1 ] || binds="$host 127.0.0.1"
# A double-quoted string in Redis' config syntax: any password, spaces and quotes included.
quoted=${PREFIXMESH_REDIS_PASSWORD//\\/\\\\}
quoted=${quoted//\"/\\\"}
# shellcheck disable=SC2086  # $binds: one or two addresses
printf 'requirepass "%s"\n' "$quoted" |
    redis-server - --port "$port" --bind $binds --save "" --appendonly no \
        --daemonize yes --pidfile "$run.pid" --logfile "$run.log"
for _ in $(seq 50); do
    if REDISCLI_AUTH=$PREFIXMESH_REDIS_PASSWORD redis-cli -h 127.0.0.1 -p "$port" ping \
        2>/dev/null | grep -q PONG; then
        echo "registry Redis on $host:$port (log $run.log)"
        exit 0
    fi
    sleep 0.1
done
echo "start-redis.sh: Redis did not answer on 127.0.0.1:$port; see $run.log" >&2
exit 1
