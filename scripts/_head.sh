# Sourced by the head benchmarks: HEAD (default: the head eagle_tree uses without a checkpoint, a trained one in
# the cache folder, else the shipped one), checked to be a head folder.
HEAD=${HEAD:-$(.venv/bin/python -c 'from vllm_treespec.proposers.eagle_tree import default_head_path; print(default_head_path())')}
if [ ! -f "$HEAD/config.json" ]; then
  echo "no EAGLE-3 head at $HEAD: run  .venv/bin/vllm-treespec train-eagle -o $HEAD  first" >&2
  exit 2
fi
