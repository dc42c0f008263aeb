#!/usr/bin/env bash
# CI on a fresh machine: install what the tests need (apt and pip), build the servers once
# (cached under ~/.cache/kvexp; Ollama from its Go module, with the machine's Go), then run the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

apt-get update -qq
apt-get install -y -qq --no-install-recommends cmake ninja-build g++ procps poppler-utils \
  libpango-1.0-0 libpangoft2-1.0-0 libharfbuzz-subset0 fonts-dejavu-core chromium \
  slurm-wlm slurmdbd munge mariadb-server util-linux mount >/dev/null

python -m pip install -q -e '.[test,fast,cluster,frame]'
python -m kvexp install llamacpp
python -m kvexp install vllm
python -m kvexp install ollama

