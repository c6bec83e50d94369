#!/usr/bin/env bash
# Execute the notebooks in place, saving their outputs (GPU mode where CuPy sees a GPU).
#
#   scripts/execute_notebooks.sh [--no-install] [NOTEBOOK.ipynb ...]
#
# On the GPU machine (Python 3.12, no Jupyter, no network) it first installs the wheels of .whl/
# (nbclient, ipykernel and their dependencies; see the list in the report / .whl/) into
# /tmp/site. `--no-install` skips that, for a machine that already has nbclient and ipykernel
# (e.g. the dev venv: `PATH=/work/venv/bin:$PATH scripts/execute_notebooks.sh --no-install`).
# Default notebooks: notebooks/0*.ipynb. Per-cell timeout: $NB_CELL_TIMEOUT seconds (default 1200).
# A notebook is overwritten only if every cell ran; a failing one is saved as
# $NB_FAILED_DIR/NAME (default /tmp) and the script exits non-zero. If $OUT is set (device
# runs), the executed notebooks are also copied there so they come back.
set -euo pipefail

cd "$(dirname "$0")/.."
install=1
if [[ "${1:-}" == "--no-install" ]]; then install=0; shift; fi
notebooks=("$@")
if [[ ${#notebooks[@]} -eq 0 ]]; then notebooks=(notebooks/0*.ipynb); fi

if [[ $install -eq 1 ]]; then
    shopt -s nullglob
    wheels=(.whl/*.whl)
    if [[ ${#wheels[@]} -eq 0 ]]; then
        echo "execute_notebooks: no wheels in .whl/ (carry .whl to the device machine)" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${wheels[@]}"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # The "python3" kernelspec, pointing at this interpreter, where jupyter_client looks for it.
    python3 -m ipykernel install --prefix /tmp/site/jupyter-prefix --name python3 >/dev/null
    export JUPYTER_PATH=/tmp/site/jupyter-prefix/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg JUPYTER_PLATFORM_DIRS=1 PYDEVD_DISABLE_FILE_VALIDATION=1
export JUPYTER_RUNTIME_DIR=${JUPYTER_RUNTIME_DIR:-/tmp/jupyter-runtime} IPYTHONDIR=${IPYTHONDIR:-/tmp/ipython}
mkdir -p "$JUPYTER_RUNTIME_DIR" "$IPYTHONDIR"

python3 - "${notebooks[@]}" <<'PY'
import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

timeout = int(os.environ.get("NB_CELL_TIMEOUT", "1200"))
failed_dir = Path(os.environ.get("NB_FAILED_DIR", "/tmp"))
out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
failures = []
for name in sys.argv[1:]:
    path = Path(name).resolve()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.time()
    print(f"executing {path.name} ...", flush=True)
    try:
        client.execute()
    except CellExecutionError as error:
        failed = failed_dir / path.name
        nbformat.write(nb, failed)
        print(f"FAILED {path.name} after {time.time() - start:.0f} s; partial notebook: {failed}\n{error}",
              file=sys.stderr, flush=True)
        failures.append(path.name)
        continue
    nbformat.write(nb, path)
    mode = next((o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []) if "mode" in o.get("text", "")), "").strip().splitlines()
    print(f"ok {path.name} in {time.time() - start:.0f} s: {mode[0] if mode else ''}", flush=True)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out_dir / path.name)
if failures:
    sys.exit(f"execute_notebooks: {len(failures)} notebook(s) failed: {', '.join(failures)}")
PY
