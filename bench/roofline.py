"""`python bench/roofline.py ...`, the command's path before the cost model had a folder of its own: it runs
cost_model/roofline.py with the same arguments (see that file)."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = str(Path(__file__).resolve().parents[1] / "cost_model" / "roofline.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
