# The two set-up commands of the README. Both install first (idempotent), so they work on a
# fresh machine with Python 3.11 and pip.
PY ?= python3

.PHONY: install run test

install:
	$(PY) -m pip install -q -r requirements/cpu.txt

run: install
	$(PY) -m attnhub run

test: install
	$(PY) -m pytest -n 2
