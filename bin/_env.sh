# Sourced by bin/demo and bin/test: create .venv and install the project with its test extras.
PYTHON_BIN=${PYTHON_BIN:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON_BIN" -m venv .venv
fi
PY=.venv/bin/python
stamp=.venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -e '.[test]'
  touch "$stamp"
fi
