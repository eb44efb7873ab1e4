# The two commands: `make run` and `make test`. `make setup` installs only.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup run test lock

setup:
	@scripts/install.sh

# The development run: DEBUG on (the settings' default is off), SQLite in data/, the
# server on 127.0.0.1 only. DEBUG=false make run asks for the production settings instead.
run: export DEBUG ?= true
run: setup
	@$(PY) manage.py migrate --noinput -v0
	@$(PY) manage.py import_demo_model
	@$(PY) manage.py ensure_demo_deployment
	@$(PY) manage.py serve

test: setup
	@scripts/ensure-chromium.sh
	@scripts/test.sh $(PYTEST_ARGS)

# Rewrite requirements/cpu.lock from the current CPU environment.
lock: setup
	@{ sed -n '1,3p' requirements/cpu.lock; \
	   $(PY) -m pip freeze --exclude-editable --disable-pip-version-check | grep -vi '^fleetplane'; \
	 } > requirements/cpu.lock.new && mv requirements/cpu.lock.new requirements/cpu.lock
