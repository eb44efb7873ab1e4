"""Who may do what: roles, the checks on pages, API endpoints and sockets, and the signal
that records changes in the audit log. Imported by controlplane/, serving/ and
models_registry/ alike; imports none of them."""
