# shellcheck shell=bash
# The environment every prefixmesh process on a `ray up` node needs. The cluster YAMLs source it
# in the same command as `ray start` (Ray runs each command in its own SSH session, and Ray's
# worker processes inherit the raylet's environment), and before the head's Redis and
# `serve deploy`:
#
#   . node-env.sh HEAD_IP REDIS_PORT SERVE_CONFIG [VENV [SECRETS]]
#
#   PREFIXMESH_REDIS_URL       redis://HEAD_IP:REDIS_PORT/0: the registry on the head, over the
#                              Serve config's registry.redis_url (prefixmesh/config/load.py)
#   PREFIXMESH_REDIS_PASSWORD  the first line of SECRETS/redis-password, a file `ray up` mounts
#                              from the operator's machine (never in the repository)
#   PATH                       VENV/bin first (ray, serve, prefixmesh, redis-server)
#   RAY_SERVE_*                with SERVE_CONFIG's serving.path=direct: Ray Serve's HAProxy
#                              ingress, from the Serve config's own serving settings through
#                              prefixmesh.local_ray.haproxy_environment (every node needs them:
#                              replicas bind their ports for HAProxy by them)
#
# VENV defaults to ~/prefixmesh-venv (setup-node.sh), SECRETS to ~/.prefixmesh-secrets.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is left alone: `=0` (a one-machine setting) makes
# `ray start --address` refuse to join.

_pm_head=${1:?node-env.sh: HEAD_IP REDIS_PORT SERVE_CONFIG [VENV [SECRETS]]}
_pm_redis_port=${2:?node-env.sh: REDIS_PORT missing}
_pm_serve_config=${3:?node-env.sh: SERVE_CONFIG missing}
_pm_venv=${4:-$HOME/prefixmesh-venv}
_pm_secrets=${5:-$HOME/.prefixmesh-secrets}

if [ ! -s "$_pm_secrets/redis-password" ]; then
    echo "node-env.sh: no Redis password in $_pm_secrets/redis-password (see README, Run on a cluster)" >&2
    return 1
fi
IFS= read -r PREFIXMESH_REDIS_PASSWORD <"$_pm_secrets/redis-password" || true
export PREFIXMESH_REDIS_PASSWORD
export PREFIXMESH_REDIS_URL="redis://$_pm_head:$_pm_redis_port/0"
export PATH="$_pm_venv/bin:$PATH"

# HAProxy's files go under one folder per account (Ray adds the node id below it; its socket
# paths must stay under 97 characters). stop-node.sh finds HAProxy by this folder: no other
# account's, and no `prefixmesh serve` folder (/tmp/pmh-XXXXXXXX, no hyphen), contains its name.
_pm_serving=$("$_pm_venv/bin/python" - "$_pm_serve_config" "/tmp/pmh-$(id -u)-node" <<'EOF'
import shlex
import sys

import yaml

from prefixmesh.config import load_config, merge_overrides
from prefixmesh.local_ray import haproxy_environment

# The settings app_builder (prefixmesh/app.py) builds the app from.
args = yaml.safe_load(open(sys.argv[1]))["applications"][0].get("args") or {}
settings = merge_overrides(args.get("settings") or {}, args.get("overrides") or [])
serving = load_config(args.get("config"), settings).serving
if serving.path == "direct":
    for name, value in haproxy_environment(serving, sys.argv[2]).items():
        print(f"export {name}={shlex.quote(value)}")
EOF
) || { echo "node-env.sh: cannot read the serving settings of $_pm_serve_config" >&2; return 1; }
eval "$_pm_serving"
unset _pm_head _pm_redis_port _pm_serve_config _pm_venv _pm_secrets _pm_serving
