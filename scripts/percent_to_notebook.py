"""Authoring aid: turn a percent-format script (`# %%`, `# %% [markdown]`, `# %% tags=["parameters"]`) into an
.ipynb without outputs. The committed .ipynb is the source of truth; this only saves typing JSON by hand.

    python scripts/percent_to_notebook.py draft.py notebooks/02_extract_hidden_states.ipynb
"""

import re
import sys

import nbformat


def convert(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3 (eagle3-workbook)", "language": "python"},
                   "language_info": {"name": "python"}}
    for chunk in re.split(r"^# %%", text, flags=re.M)[1:]:
        header, _, body = chunk.partition("\n")
        body = body.strip("\n")
        if "[markdown]" in header:
            source = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(body)
            if 'tags=["parameters"]' in header:
                cell.metadata["tags"] = ["parameters"]
            nb.cells.append(cell)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    nbformat.write(convert(open(src).read()), dst)
    print(f"wrote {dst}")
