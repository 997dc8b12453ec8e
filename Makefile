# The two set-up commands of the README. Both install .venv first (scripts/install.sh; a no-op when up to date).
VENV ?= .venv
CONFIG ?= configs/demo.yaml

.PHONY: demo test lab lint install browser

install:
	bash scripts/install.sh $(VENV)

demo: install   ## the whole pipeline, headless, on the embedded default (SmolLM2-135M on the CPU)
	$(VENV)/bin/eagle3 run --config $(CONFIG)

browser:        ## Debian's chromium for the JupyterLab browser test (root installs it; anyone else is told how)
	bash scripts/install-browser.sh

test: install browser   ## the whole test suite, the browser test included (what CI runs), two files at a time
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

lab: install    ## the workbook in JupyterLab (127.0.0.1, with a token)
	$(VENV)/bin/eagle3 lab

lint: install
	$(VENV)/bin/ruff check eagle3lib tests benchmarks scripts
