#!/usr/bin/env bash
# mypy over the modules pyproject.toml types (strict where [[tool.mypy.overrides]] says so).
#
# The top-level folders are the `tokenmill.*` subpackages only through pyproject's package-dir (installed) or
# tokenmill/_source_tree.py (a checkout); mypy sees neither, so this builds the installed layout from symlinks in
# a temporary folder and checks the modules by their package names. Extra arguments go to mypy.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
layout="$(mktemp -d)"
trap 'rm -rf "$layout"' EXIT
mkdir "$layout/tokenmill"
ln -s "$root"/tokenmill/*.py "$layout/tokenmill/"
for folder in frontend scheduler workers kernels; do
  ln -s "$root/$folder" "$layout/tokenmill/$folder"
done
cd "$layout"
mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" "$@" \
  -p tokenmill.scheduler -m tokenmill.messages -m tokenmill.stats -m tokenmill.frontend.engine_protocol \
  -m tokenmill.workers.worker -m tokenmill.workers.request_state -m tokenmill.workers.step_inputs -m tokenmill.workers.step_forward -m tokenmill.workers.sample_stage -m tokenmill.workers.kv_cache \
  -m tokenmill.workers.distributed -m tokenmill.workers.memory_profile -m tokenmill.workers.model_facts -m tokenmill.workers.attention -m tokenmill.workers.cpu_backend \
  -m tokenmill.workers.triton_backend -m tokenmill.workers.pipeline_parallel -m tokenmill.workers.process -m tokenmill.workers.rendezvous \
  -m tokenmill.workers.sample_profile -m tokenmill.workers.capture_plan -m tokenmill.workers.cuda_graphs -m tokenmill.workers.collectives \
  -m tokenmill.workers.staging -m tokenmill.workers.warm_up -m tokenmill.workers.cpu_verify_graphs -m tokenmill.workers.host_memory \
  -m tokenmill.lora -p tokenmill.workers.lora
