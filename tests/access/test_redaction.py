"""The redaction every surface uses: what counts as a secret, and what is kept."""

from __future__ import annotations

from access.redaction import keep_redacted, redact


def test_secret_named_settings_are_masked_and_others_kept() -> None:
    config = {"api_key": "k", "auth_header": "Basic x", "client_secret": "s",
              "db_password": "p", "credentials_file": "/c", "kv_cache_gib": 4,
              "hf_token_secret": "hf-token", "image_pull_secrets": ["regcred"],
              "api_key_unset": ""}
    assert redact(config) == {"api_key": "***", "auth_header": "***", "client_secret": "***",
                              "db_password": "***", "credentials_file": "***",
                              "kv_cache_gib": 4, "hf_token_secret": "hf-token",
                              "image_pull_secrets": ["regcred"], "api_key_unset": ""}


def test_every_env_value_is_masked_in_both_forms() -> None:
    assert redact({"env": {"A": "1"}}) == {"env": {"A": "***"}}
    assert redact({"env": [{"name": "A", "value": "1"},
                           {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}) == {
        "env": [{"name": "A", "value": "***"},
                {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}


def test_urls_keep_their_user_and_host_and_lose_their_password_and_tokens() -> None:
    assert redact("see https://u:p@h:8/x?access_token=t&page=2 and http://h/y") == (
        "see https://u:***@h:8/x?access_token=***&page=2 and http://h/y")
    assert redact("https://only-a-token@h/") == "https://***@h/"


def test_secret_flags_on_a_command_line_lose_their_values() -> None:
    assert redact({"extra_args": ["--api-key", "k", "--seed", "3", "--hf-token=t",
                                  "--tokenizer-mode", "slow"]}) == {
        "extra_args": ["--api-key", "***", "--seed", "3", "--hf-token=***",
                       "--tokenizer-mode", "slow"]}


def test_a_value_sent_back_masked_is_the_stored_one() -> None:
    stored = {"url": "https://u:p@h/?token=t", "api_key": "k", "env": {"A": "1"}}
    sent = {**redact(stored), "env": {"A": "***", "B": "2"}}
    assert keep_redacted(sent, stored) == {"url": "https://u:p@h/?token=t", "api_key": "k",
                                           "env": {"A": "1", "B": "2"}}
    assert keep_redacted({**sent, "api_key": "new"}, stored)["api_key"] == "new"
