#!/usr/bin/env bash
# Execute the notebooks in place and save their outputs, in the current Python environment.
#
#   bash scripts/execute_notebooks.sh [NOTEBOOK.ipynb ...]     (default: notebooks/*.ipynb)
#
# Needs the "notebooks" extra (nbclient, nbformat, ipykernel): pip install -e ".[notebooks]".
# The notebooks measure live where CuPy and torch see a GPU and replay the recorded results
# otherwise; ALTUP_NOTEBOOK_MODE=gpu demands a GPU, =cpu forces the replay.
# Per-cell time limit: NB_CELL_TIMEOUT seconds (default 1200). A notebook is overwritten only if
# every cell ran; a failing one is saved to NB_FAILED_DIR (default: a new temporary folder, printed)
# and the script exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
notebooks=("$@")
if [ ${#notebooks[@]} -eq 0 ]; then
  shopt -s nullglob
  notebooks=(notebooks/*.ipynb)
  shopt -u nullglob
fi
if [ ${#notebooks[@]} -eq 0 ]; then
  echo "execute_notebooks.sh: no notebooks to execute" >&2
  exit 2
fi
if ! python3 -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
  echo "execute_notebooks.sh: nbclient, nbformat and ipykernel are needed: pip install -e '.[notebooks]'" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg
export NB_FAILED_DIR=${NB_FAILED_DIR:-$(mktemp -d)}

python3 - "${notebooks[@]}" <<'PY'
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

timeout = int(os.environ.get("NB_CELL_TIMEOUT", "1200"))
failed_dir = Path(os.environ["NB_FAILED_DIR"])
failures = []
for name in sys.argv[1:]:
    path = Path(name).resolve()
    notebook = nbformat.read(path, as_version=4)
    # The "python3" kernel is this interpreter (ipykernel's own kernelspec).
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.time()
    print(f"executing {path.name} ...", flush=True)
    try:
        client.execute()
    except CellExecutionError as error:
        failed = failed_dir / path.name
        nbformat.write(notebook, failed)
        print(f"FAILED {path.name} after {time.time() - start:.0f} s; partial notebook: {failed}\n{error}",
              file=sys.stderr, flush=True)
        failures.append(path.name)
        continue
    nbformat.write(notebook, path)
    mode = next((line for cell in notebook.cells if cell.cell_type == "code"
                 for output in cell.get("outputs", []) for line in output.get("text", "").splitlines()
                 if "mode" in line), "")
    print(f"ok {path.name} in {time.time() - start:.0f} s: {mode}", flush=True)
if failures:
    sys.exit(f"execute_notebooks.sh: {len(failures)} notebook(s) failed: {', '.join(failures)}")
PY
