"""One settings module: every knob comes from an environment variable.

DEBUG is off unless asked for. Off, the process refuses to start without SECRET_KEY,
ALLOWED_HOSTS and PostgreSQL. The development run (`make run`, which sets DEBUG=true)
runs on SQLite in DATA_DIR with the in-memory channel layer and needs nothing else.
Every variable is listed in docs/configuration.md.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import django_stubs_ext

from controlplane.envconfig import (
    SettingError,
    database_from_url,
    env_absolute_paths,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_labels,
    env_list,
    env_path,
    env_str,
    redis_url,
)
from serving.priority import parse_classes
from serving.proxies import parse_networks as _trusted_networks

# Lets the admin and forms be written with type parameters (ModelAdmin[Model]).
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent

# Off unless asked for: a server started without settings must not show debug pages.
# `make run` (the development run) sets DEBUG=true.
DEBUG = env_bool("DEBUG", False)
DATA_DIR = env_path("DATA_DIR", BASE_DIR / "data")
MODELS_DIR = env_path("MODELS_DIR", DATA_DIR / "models")

_secret = env_str("SECRET_KEY")
if not DEBUG and not _secret:
    raise SettingError("SECRET_KEY must be set when DEBUG is false (the default). "
                       "In production set SECRET_KEY, ALLOWED_HOSTS and DATABASE_URL "
                       "(docs/operations.md); for a development run on this machine set "
                       "DEBUG=true, as `make run` does")
if not DEBUG and len(_secret) < 50:
    raise SettingError("SECRET_KEY must be at least 50 characters when DEBUG is false")
# The embedded default has no secret to keep across restarts beyond sessions; a fixed
# development key is acceptable there and refused in production above.
SECRET_KEY = _secret or "django-insecure-embedded-default-key-do-not-use-in-production-0123456789"
# Earlier secret keys, while rotating: sessions signed and engine keys sealed under them
# still open (serving/sealing.py).
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"] if DEBUG else [])
if not DEBUG and not ALLOWED_HOSTS:
    raise SettingError("ALLOWED_HOSTS must be set when DEBUG is false")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

# --- Safe defaults (docs/security.md) ------------------------------------------------
# Debug pages (DEBUG on) hide secret-looking settings and variables, and the credentials
# in URLs such as DATABASE_URL and REDIS_URL.
DEFAULT_EXCEPTION_REPORTER_FILTER = "controlplane.debug.CredentialHidingFilter"
# /metrics answers only with `Authorization: Bearer <METRICS_TOKEN>` when it is set.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")
# Failed logins (the login page and the admin's) counted per username and per client
# address; at this many within a minute, further attempts are refused until the minute
# has passed. 0 turns the limit off. Counts are kept in Redis when REDIS_URL is set.
LOGIN_FAILURES_PER_MINUTE = env_int("LOGIN_FAILURES_PER_MINUTE", 5, minimum=0)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "models_registry",
    "serving",
    "controlplane",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "access.roles.context",
            ],
        },
    },
]

_database_url = env_str("DATABASE_URL")
if _database_url:
    DATABASES = {"default": database_from_url("DATABASE_URL", _database_url)}
else:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "db.sqlite3",
            # Several threads (the ASGI server, importers) share this file.
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
            # Each thread keeps its connection between the controllers' passes (about one
            # a second), as with PostgreSQL, rather than opening the file, registering
            # SQLite's functions and closing it again every time (bench/idle_cpu.py).
            "CONN_MAX_AGE": 60,
            # Tests use a file too: an in-memory database shared between threads fails
            # with "table is locked" where a file waits for its lock.
            "TEST": {"NAME": str(DATA_DIR / "test-db.sqlite3")},
        }
    }
if not DEBUG and str(DATABASES["default"]["ENGINE"]).endswith("sqlite3") and not env_bool(
    "ALLOW_SQLITE_IN_PRODUCTION", False
):
    raise SettingError(
        "DEBUG is false but no DATABASE_URL is set: production needs PostgreSQL "
        "(set ALLOW_SQLITE_IN_PRODUCTION=true to override for a single-node trial)"
    )

REDIS_URL = redis_url("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "registry"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = env_path("STATIC_ROOT", DATA_DIR / "static")
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG
# WhiteNoise hands Django's ASGI handler a file iterator; Django warns that it consumes it
# in a thread. Static files are small and few; the warning would only fill the log.
warnings.filterwarnings("ignore", message="StreamingHttpResponse must consume synchronous")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "serving.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["access.roles.RolePermission"],
    "DEFAULT_SCHEMA_CLASS": "controlplane.api.schema.ApiSchema",
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "controlplane.api.pagination.Page",
    "PAGE_SIZE": 50,
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Fleetplane API",
    "DESCRIPTION": "REST API of the Fleetplane control plane for vLLM fleets.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and its browsable page need a role too (viewer or above, or an admin key).
    "SERVE_PERMISSIONS": ["access.roles.RolePermission"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Bodies are documented as JSON, the one form clients of this API send.
    "PARSER_WHITELIST": ["rest_framework.parsers.JSONParser"],
    "ENUM_NAME_OVERRIDES": {"UserRoleEnum": "access.roles.USER_ROLE_CHOICES"},
}

# Model registry: whether importers may contact the Hugging Face Hub for metadata.
HUB_ACCESS = env_bool("HUB_ACCESS", False)
HF_ENDPOINT = env_str("HF_ENDPOINT", "https://huggingface.co")
HUB_TIMEOUT_SECONDS = env_int("HUB_TIMEOUT_SECONDS", 10, minimum=1, maximum=300)

# REST API input bounds and model import roots (docs/security.md).
# The most rows one list request returns (`?limit=` above it is cut to it).
API_MAX_PAGE_SIZE = env_int("API_MAX_PAGE_SIZE", 500, minimum=1, maximum=100_000)
# Folders a local model path may be registered from (symlinks and ".." resolved first).
# Empty: MODELS_DIR and DATA_DIR/models.
MODEL_IMPORT_ROOTS = [Path(root) for root in env_list("MODEL_IMPORT_ROOTS")]

# Controllers: the reconciler and the replicas it keeps running.
RECONCILE_INTERVAL_SECONDS = env_float("RECONCILE_INTERVAL_SECONDS", 1.0, minimum=0.05,
                                       maximum=60)
REPLICA_STARTUP_TIMEOUT_SECONDS = env_int("REPLICA_STARTUP_TIMEOUT_SECONDS", 900, minimum=10)
RESTART_BACKOFF_BASE_SECONDS = env_float("RESTART_BACKOFF_BASE_SECONDS", 5.0, minimum=0.1)
RESTART_BACKOFF_MAX_SECONDS = env_float("RESTART_BACKOFF_MAX_SECONDS", 300.0, minimum=1)
HEALTH_CHECK_SECONDS = env_float("HEALTH_CHECK_SECONDS", 5.0, minimum=0.0)
# An external endpoint that keeps failing its probe is probed on a backoff up to this.
HEALTH_BACKOFF_MAX_SECONDS = env_float("HEALTH_BACKOFF_MAX_SECONDS", 60.0, minimum=0.0)
# A full reconcile pass at least this often, whatever the change checks say (a safety
# net for a write the audit log does not see, e.g. a SQL shell).
RECONCILE_RESYNC_SECONDS = env_float("RECONCILE_RESYNC_SECONDS", 60.0, minimum=1.0)
HEALTH_RECORD_SECONDS = env_int("HEALTH_RECORD_SECONDS", 10, minimum=1)
HEALTH_FAILURE_SECONDS = env_int("HEALTH_FAILURE_SECONDS", 30, minimum=1)
DRAIN_TIMEOUT_SECONDS = env_int("DRAIN_TIMEOUT_SECONDS", 30, minimum=0)
STOP_GRACE_SECONDS = env_int("STOP_GRACE_SECONDS", 15, minimum=1)
# The audit log: an event identical to one seen within EVENT_COALESCE_SECONDS (0: never)
# adds to that row's count; rows last seen longer ago than AUDIT_RETENTION_DAYS are pruned
# every AUDIT_PRUNE_INTERVAL_SECONDS, security events (keys, users, teams, backends) after
# AUDIT_SECURITY_RETENTION_DAYS. EVENTS_COUNT_LIMIT caps the `count` of an events page.
EVENT_COALESCE_SECONDS = env_int("EVENT_COALESCE_SECONDS", 600, minimum=0, maximum=86_400)
AUDIT_RETENTION_DAYS = env_int("AUDIT_RETENTION_DAYS", 30, minimum=1)
AUDIT_SECURITY_RETENTION_DAYS = env_int("AUDIT_SECURITY_RETENTION_DAYS", 365, minimum=1)
AUDIT_PRUNE_INTERVAL_SECONDS = env_int("AUDIT_PRUNE_INTERVAL_SECONDS", 3600, minimum=1)
EVENTS_COUNT_LIMIT = env_int("EVENTS_COUNT_LIMIT", 10_000, minimum=1)
# One active controller among several: `kubernetes` elects it through a Lease (the
# controller Deployment in deploy/ sets it); `none`: this process always runs them.
LEADER_ELECTION = env_choice("LEADER_ELECTION", "none", ("none", "kubernetes"))
LEADER_ELECTION_NAMESPACE = env_str("LEADER_ELECTION_NAMESPACE", env_str("POD_NAMESPACE", ""))
LEADER_ELECTION_LEASE = env_str("LEADER_ELECTION_LEASE", "fleetplane-controller")
LEADER_ELECTION_IDENTITY = env_str("POD_NAME", "")
LEADER_ELECTION_LEASE_SECONDS = env_int("LEADER_ELECTION_LEASE_SECONDS", 15, minimum=2)
# The local backend's defaults for `make run`'s demo deployment and new local backends.
LOCAL_KV_CACHE_GIB = env_int("LOCAL_KV_CACHE_GIB", 1, minimum=1)

# --- What an admin may configure in a backend (docs/security.md): allow-lists set by
# whoever runs the install, so an admin key cannot make the control plane run any
# program, image or mount it likes. Checked wherever a backend config is validated.
# Interpreters the local backend's `python` may name (absolute paths; the control plane's
# own interpreter is always allowed, and is what an empty `python` means).
LOCAL_BACKEND_PYTHONS = env_absolute_paths("LOCAL_BACKEND_PYTHONS")
# Images the kubernetes backend may run: `repository` (any tag) or `repository:tag`.
KUBERNETES_ALLOWED_IMAGES = env_list("KUBERNETES_ALLOWED_IMAGES",
                                     ["vllm/vllm-openai", "docker.io/vllm/vllm-openai"])
# Node paths (prefixes) a kubernetes backend may mount with model_source `hostPath`: none
# unless set.
KUBERNETES_ALLOWED_HOST_PATHS = env_absolute_paths("KUBERNETES_ALLOWED_HOST_PATHS")
# Service accounts vLLM pods may run as (none: the namespace's default; pods never get a
# token mounted either way).
KUBERNETES_ALLOWED_SERVICE_ACCOUNTS = env_list("KUBERNETES_ALLOWED_SERVICE_ACCOUNTS")
# PriorityClasses vLLM pods may take (none unless set: a high class preempts other work).
KUBERNETES_ALLOWED_PRIORITY_CLASSES = env_list("KUBERNETES_ALLOWED_PRIORITY_CLASSES")
# Claims a kubernetes backend may mount read-write as its download cache (none unless set;
# `pvc_name` claims are mounted read-only).
KUBERNETES_ALLOWED_CACHE_CLAIMS = env_list("KUBERNETES_ALLOWED_CACHE_CLAIMS")
# Prometheus servers a KEDA ScaledObject may name (KEDA's operator queries them).
KUBERNETES_ALLOWED_PROMETHEUS_ADDRESSES = env_list(
    "KUBERNETES_ALLOWED_PROMETHEUS_ADDRESSES", ["http://prometheus.monitoring:9090"])
# Who the NetworkPolicy of each deployment admits to the replica port: the gateway and
# controller pods of the control plane's namespace, and Prometheus where its labels are set.
KUBERNETES_CONTROL_PLANE_NAMESPACE = env_str("KUBERNETES_CONTROL_PLANE_NAMESPACE",
                                             env_str("POD_NAMESPACE", "fleetplane"))
KUBERNETES_GATEWAY_POD_LABELS = env_labels("KUBERNETES_GATEWAY_POD_LABELS", {
    "app.kubernetes.io/name": "fleetplane", "app.kubernetes.io/component": "gateway"})
KUBERNETES_CONTROLLER_POD_LABELS = env_labels("KUBERNETES_CONTROLLER_POD_LABELS", {
    "app.kubernetes.io/name": "fleetplane", "app.kubernetes.io/component": "controller"})
KUBERNETES_PROMETHEUS_NAMESPACE = env_str("KUBERNETES_PROMETHEUS_NAMESPACE", "monitoring")
KUBERNETES_PROMETHEUS_POD_LABELS = env_labels("KUBERNETES_PROMETHEUS_POD_LABELS")
# This install's name on the Kubernetes objects it makes: the label fleetplane.io/install on
# every object and in every selector, so two installs sharing a namespace never list,
# adopt or delete each other's objects; an install other than the default also prefixes
# its object names with it. A DNS label of at most 20 characters starting with a letter
# (a valid label value, and short enough to prefix a name). Fixed for the install's life.
INSTALL_ID = env_str("INSTALL_ID", "fleetplane")
if not re.fullmatch(r"[a-z]([-a-z0-9]{0,18}[a-z0-9])?", INSTALL_ID):
    raise SettingError(f"INSTALL_ID={INSTALL_ID!r}: use 1 to 20 lower-case letters, digits "
                       f"and hyphens, starting with a letter and ending with a letter or "
                       f"digit")
# --- end of the backend allow-lists

# Every route but /v1/*: bodies over this get 413 before Django reads them.
HTTP_MAX_BODY_BYTES = env_int("HTTP_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)

# The OpenAI-compatible gateway (/v1/*).
GATEWAY_MAX_BODY_BYTES = env_int("GATEWAY_MAX_BODY_BYTES", 8 * 1024 * 1024, minimum=1024)
GATEWAY_LOAD_SCRAPE_SECONDS = env_float("GATEWAY_LOAD_SCRAPE_SECONDS", 1.0, minimum=0.1)
# How long a request for a deployment scaled to zero waits for a replica to come up.
GATEWAY_COLD_START_WAIT_SECONDS = env_float("GATEWAY_COLD_START_WAIT_SECONDS", 180.0,
                                            minimum=0.0)
KEY_CACHE_SECONDS = env_float("KEY_CACHE_SECONDS", 60.0, minimum=0.0)
# Admission (docs/admission.md): priority classes, queue aging, per-replica concurrency,
# failed-authentication limits per client address.
try:
    PRIORITY_CLASSES = parse_classes(env_str("PRIORITY_CLASSES", ""))
except ValueError as _exc:
    raise SettingError(str(_exc)) from None
# Every this many seconds waited counts as one level more urgent, so no class starves.
GATEWAY_QUEUE_AGING_SECONDS = env_float("GATEWAY_QUEUE_AGING_SECONDS", 10.0, minimum=0.1)
# Requests one replica takes at once before the gateway queues, unless the deployment
# says (its `replica_concurrency`, else its engine argument max_num_seqs).
GATEWAY_REPLICA_CONCURRENCY = env_int("GATEWAY_REPLICA_CONCURRENCY", 256, minimum=1)
# Failed authentication attempts one client address may make per minute before further
# failed attempts get 429 (a request with a valid key is never refused by it); 0: no limit.
GATEWAY_AUTH_FAILURES_PER_MINUTE = env_int("GATEWAY_AUTH_FAILURES_PER_MINUTE", 30, minimum=0)
# Proxies (addresses or networks) whose X-Forwarded-For names the client (serving/proxies.py);
# empty: the connection's address is the client, whatever the headers say.
TRUSTED_PROXIES = env_list("TRUSTED_PROXIES")
try:
    _trusted_networks(TRUSTED_PROXIES)
except ValueError as _exc:
    raise SettingError(f"TRUSTED_PROXIES: {_exc}") from None
USAGE_FLUSH_SECONDS = env_float("USAGE_FLUSH_SECONDS", 1.0, minimum=0.05)
# Limits on what one caller can hold (docs/admission.md): requests of one API key between
# authentication and the end of their answer (0: no limit), the share of a class's queue
# one key may fill, the size of a non-streamed answer relayed.
GATEWAY_KEY_MAX_IN_FLIGHT = env_int("GATEWAY_KEY_MAX_IN_FLIGHT", 512, minimum=0)
GATEWAY_KEY_QUEUE_SHARE = env_float("GATEWAY_KEY_QUEUE_SHARE", 0.5, minimum=0.01, maximum=1.0)
GATEWAY_MAX_RESPONSE_BYTES = env_int("GATEWAY_MAX_RESPONSE_BYTES", 64 * 1024 * 1024,
                                     minimum=1024)
# The longest the gateway waits for a replica's next bytes (a stream's head, each piece
# after it; a whole answer's body once it began): a hung replica's streams then end with an
# SSE error instead of hanging, and a request it holds before answering goes to another
# replica. 0: no limit.
GATEWAY_UPSTREAM_IDLE_SECONDS = env_float("GATEWAY_UPSTREAM_IDLE_SECONDS", 60.0, minimum=0.0)
# A kept-alive connection the replica closes (its own keep-alive ran out) is replaced by a
# new one when it carried a request within this many seconds, so the next burst finds its
# connections open; the replacement is closed when the window ends unless a request used
# it. 0: connections are let go when the replica closes them.
GATEWAY_UPSTREAM_WARM_SECONDS = env_float("GATEWAY_UPSTREAM_WARM_SECONDS", 60.0, minimum=0.0,
                                          maximum=86_400.0)

# The metrics collector and the live dashboards.
SCRAPE_INTERVAL = env_float("SCRAPE_INTERVAL", 2.0, minimum=0.2)
SCRAPE_TIMEOUT = env_float("SCRAPE_TIMEOUT", 1.5, minimum=0.1)
DCGM_EXPORTER_URL = env_str("DCGM_EXPORTER_URL", "")

# The playground (WebSocket /ws/playground/).
PLAYGROUND_MAX_TOKENS = env_int("PLAYGROUND_MAX_TOKENS", 4096, minimum=1)
PLAYGROUND_MAX_PROMPT_CHARS = env_int("PLAYGROUND_MAX_PROMPT_CHARS", 100_000, minimum=1)
WEBSOCKET_MAX_MESSAGE_BYTES = env_int("WEBSOCKET_MAX_MESSAGE_BYTES", 256 * 1024, minimum=1024)
WEBSOCKET_MESSAGES_PER_SECOND = env_float("WEBSOCKET_MESSAGES_PER_SECOND", 5.0, minimum=0.1)

# The ASGI server of `manage.py serve`.
SERVE_HOST = env_str("HOST", "127.0.0.1")
SERVE_PORT = env_int("PORT", 8000, minimum=1, maximum=65535)
# Gateway worker processes of `manage.py serve` on its one port (more than 1 needs
# REDIS_URL: docs/operations.md, "Worker processes").
GATEWAY_WORKERS = env_int("GATEWAY_WORKERS", 1, minimum=1, maximum=256)

LOG_LEVEL = env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain",
                             "stream": sys.stderr}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "INFO"}, "httpx": {"level": "WARNING"},
                "httpx2": {"level": "WARNING"}},
}

if not DEBUG:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
