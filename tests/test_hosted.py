"""Hosted use: the server config (XSRF, upload cap), viewer mode on every page, the sign-in gate and its allow-list,
the upload total cap, and DuckDB memory/threads from the environment. One real-browser check pins that the first
request a fresh server gets for a page URL still goes through app.py (the sign-in gate)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest, app_test

from analysis.settings import SettingError
from ui import access
from ui.auth import AllowList

from helpers import browser as bu
from helpers.apptest import PAGES, TIMEOUT, NavigationOnly, errors, overview_cards, texts

APP = str(bu.ROOT / "app.py")
AUTH = {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "test-cookie-secret",
        "client_id": "test-client", "client_secret": "test-secret",
        "server_metadata_url": "https://idp.example.org/.well-known/openid-configuration"}
ANN = {"is_logged_in": True, "name": "Ann *Admin*", "email": "ann@example.org", "email_verified": True}
WRITE_KEYS = {"data_load", "data_run_name", "data_cfg_save", "data_cfg_text", "data_del_button", "data_del_confirm",
              "data_del_run", "data_cfg_run", "lab_start", "lab_run_name"}


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    monkeypatch.setattr(app_test, "PagesManager", NavigationOnly)
    monkeypatch.setenv("DRIFT_NO_DEMO", "1")
    monkeypatch.setenv("DRIFT_PREFETCH", "0")
    for name in ("DRIFT_READ_ONLY", "DRIFT_ALLOWED_EMAILS", "DRIFT_ALLOWED_DOMAIN", "DRIFT_MAX_UPLOAD_MB",
                 "DRIFT_MEMORY_LIMIT", "DRIFT_THREADS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def db(app_template_db, tmp_path) -> Path:
    path = tmp_path / "drift.duckdb"
    shutil.copy(app_template_db, path)
    return path


def app(monkeypatch, db: Path, secrets: dict | None = None, user: dict | None = None) -> AppTest:
    monkeypatch.setenv("DRIFT_DB", str(db))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    if secrets:
        for k, v in secrets.items():
            at.secrets[k] = v
    if user is not None:
        at.user = user
    return at.run()


def page_titles(at: AppTest) -> list[str]:
    return [t.value for t in at.title]


# -- server config ---------------------------------------------------------------------------------------
def test_config_toml_is_hardened():
    cfg = tomllib.loads((bu.ROOT / ".streamlit" / "config.toml").read_text())
    server = cfg["server"]
    assert server["enableXsrfProtection"] is True and server["enableCORS"] is True  # XSRF is no use without CORS
    assert isinstance(server["maxUploadSize"], int) and 1 <= server["maxUploadSize"] <= 2048
    assert server.get("enableStaticServing", False) is False and server.get("runOnSave", False) is False
    assert cfg["client"]["showErrorDetails"] == "none" and cfg["client"]["toolbarMode"] == "minimal"
    assert cfg["browser"]["gatherUsageStats"] is False


def test_secrets_example_documents_auth_with_placeholders():
    example = tomllib.loads((bu.ROOT / ".streamlit" / "secrets.example.toml").read_text())
    auth = example["auth"]
    assert set(auth) == {"redirect_uri", "cookie_secret", "client_id", "client_secret", "server_metadata_url"}
    assert auth["redirect_uri"].endswith("/oauth2callback")
    for key in ("cookie_secret", "client_id", "client_secret"):
        assert auth[key].startswith("REPLACE-"), key  # never a real secret in the repository


@pytest.mark.slow  # AppTest
# -- viewer mode -----------------------------------------------------------------------------------------
def test_viewer_mode_on_every_page_and_a_read_only_database(monkeypatch, db):
    from analysis.store import StoreError
    from ui import state as S

    monkeypatch.setenv("DRIFT_READ_ONLY", "1")
    at = app(monkeypatch, db)
    for page, title in PAGES.items():
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
        assert page_titles(at)[0] == title and not errors(at), (page, errors(at))
        keys = {w.key for kind in ("button", "text_input", "text_area", "selectbox", "file_uploader")
                for w in at.get(kind)}
        assert not keys & WRITE_KEYS, (page, keys & WRITE_KEYS)
        assert not at.get("file_uploader"), page
        if page in ("pages/data.py", "pages/lab.py"):
            assert "viewer mode" in texts(at.info), page
    assert "viewer mode" in texts(at.caption)  # the sidebar says so
    store = S._open(str(db), True, False).store  # the one Store the app opened (st.cache_resource)
    assert store.read_only
    with pytest.raises(StoreError, match="read-only"):
        store.set_run_config(bu.RUN_DENSE, {"x": 1})


@pytest.mark.slow  # AppTest
# -- sign-in ---------------------------------------------------------------------------------------------
def test_without_secrets_the_app_opens_without_sign_in(monkeypatch, db):
    at = app(monkeypatch, db)
    assert not at.exception and page_titles(at) == ["Overview"]
    assert not [b for b in at.button if (b.key or "").startswith("auth_")]


@pytest.mark.slow  # AppTest
def test_with_auth_secrets_only_the_sign_in_screen_shows(monkeypatch, db):
    at = app(monkeypatch, db, {"auth": AUTH}, {"is_logged_in": False})
    assert not at.exception, at.exception
    assert page_titles(at) == ["Driftscope"] and "Sign in to continue" in texts(at.markdown)
    assert [b.label for b in at.button] == ["Sign in"]
    assert not overview_cards(at) and not at.dataframe and not at.multiselect  # no page content, no run picker
    at.switch_page("pages/data.py").run()  # a page URL gives the same screen
    assert page_titles(at) == ["Driftscope"] and not at.get("file_uploader")


@pytest.mark.slow  # AppTest
def test_signed_in_user_sees_the_app_and_can_log_out(monkeypatch, db):
    monkeypatch.setenv("DRIFT_ALLOWED_DOMAIN", "example.org")
    at = app(monkeypatch, db, {"auth": AUTH}, dict(ANN))
    assert not at.exception and page_titles(at) == ["Overview"] and overview_cards(at)
    assert r"Signed in as **Ann \*Admin\***" in texts(at.sidebar.caption)  # the name's markdown is escaped
    at.button(key="auth_logout").click().run()
    assert at.user == {"is_logged_in": False} and not overview_cards(at)  # that run stops; the next is signed out
    at.run()
    assert page_titles(at) == ["Driftscope"] and not overview_cards(at)


@pytest.mark.slow  # AppTest
def test_one_sign_in_button_per_provider(monkeypatch, db):
    providers = {k: AUTH[k] for k in ("redirect_uri", "cookie_secret")} | {
        "google": {k: AUTH[k] for k in ("client_id", "client_secret", "server_metadata_url")},
        "okta": {k: AUTH[k] for k in ("client_id", "client_secret", "server_metadata_url")}
        | {"client_kwargs": {"prompt": "login"}}}
    at = app(monkeypatch, db, {"auth": providers}, {"is_logged_in": False})
    assert [b.label for b in at.button] == ["Sign in with Google", "Sign in with Okta"]
    at = app(monkeypatch, db, {"auth": AUTH | {"client_kwargs": {"prompt": "login"}}}, {"is_logged_in": False})
    assert [b.label for b in at.button] == ["Sign in"]


@pytest.mark.slow  # AppTest
def test_allow_list_keeps_other_accounts_out(monkeypatch, db):
    monkeypatch.setenv("DRIFT_ALLOWED_EMAILS", "bob@example.org")
    at = app(monkeypatch, db, {"auth": AUTH}, dict(ANN))
    assert not at.exception and page_titles(at) == ["Driftscope"] and not overview_cards(at)
    assert "is not allowed to use this Driftscope" in errors(at)[0]
    assert at.button(key="auth_denied_logout")


@pytest.mark.slow  # AppTest
@pytest.mark.parametrize("secrets, env, message", [
    ({"auth": {k: v for k, v in AUTH.items() if k != "cookie_secret"}}, {}, "lacks cookie_secret"),
    ({"other": {"x": 1}}, {"DRIFT_ALLOWED_DOMAIN": "example.org"}, "nobody can sign in"),
    (tomllib.loads((bu.ROOT / ".streamlit" / "secrets.example.toml").read_text()), {}, "REPLACE-… placeholders"),
])
def test_broken_sign_in_settings_keep_the_app_closed(monkeypatch, db, secrets, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    at = app(monkeypatch, db, secrets, dict(ANN))
    assert not at.exception and "Overview" not in page_titles(at) and not overview_cards(at)
    assert message in " ".join(errors(at))


@pytest.mark.parametrize("env, user, admitted", [
    ({}, {"email": "anyone@anywhere.net"}, True),
    ({"DRIFT_ALLOWED_EMAILS": "Ann@Example.org, bob@x.io"}, {"email": "ann@example.org"}, True),
    ({"DRIFT_ALLOWED_EMAILS": "ann@example.org"}, {"email": "eve@example.org"}, False),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "eve@EXAMPLE.org"}, True),
    ({"DRIFT_ALLOWED_DOMAIN": "@example.org"}, {"email": "eve@example.org"}, True),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "eve@evil-example.org"}, False),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "eve@example.org.evil.com"}, False),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "eve@sub.example.org"}, False),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "a@b@example.org"}, False),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "eve@example.org", "email_verified": False}, False),
    ({"DRIFT_ALLOWED_DOMAIN": "example.org"}, {"name": "no email claim"}, False),
    ({"DRIFT_ALLOWED_EMAILS": "x@y.z", "DRIFT_ALLOWED_DOMAIN": "example.org"}, {"email": "ann@example.org"}, True),
])
def test_allow_list(env, user, admitted):
    assert AllowList.from_env(env).admits(user) is admitted


# -- upload cap ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, mib", [(None, 1024), ("", 1024), ("64", 64), ("0.5", 0.5)])
def test_max_upload_bytes_from_env(value, mib):
    env = {} if value is None else {"DRIFT_MAX_UPLOAD_MB": value}
    assert access.max_upload_bytes(env) == int(mib * access.MiB)


@pytest.mark.parametrize("value", ["0", "-3", "lots", "inf", "nan"])
def test_a_max_upload_that_is_no_positive_number_is_an_error_not_a_lifted_cap(value):
    with pytest.raises(SettingError, match=f"^DRIFT_MAX_UPLOAD_MB='{value}': expected a positive number of MiB$"):
        access.max_upload_bytes({"DRIFT_MAX_UPLOAD_MB": value})


def test_upload_refusal_counts_the_whole_upload():
    cap = 10 * access.MiB
    assert access.upload_refusal([], cap) is None
    assert access.upload_refusal([4 * access.MiB, 6 * access.MiB], cap) is None  # exactly the cap fits
    msg = access.upload_refusal([4 * access.MiB, 6 * access.MiB, 1], cap)
    assert msg.startswith("The upload holds 3 files of 10.0 MiB together, over this server's cap of 10.0 MiB")
    assert "DRIFT_MAX_UPLOAD_MB" in msg and "Load fewer files at once" in msg
    assert "1 file of" in access.upload_refusal([11 * access.MiB], cap)


@pytest.mark.slow  # AppTest
def test_data_page_refuses_an_upload_over_the_total_cap(monkeypatch, db, tmp_path):
    tokens = bu.fixture_tokens("capped", 5, steps=1, n_seq=2)
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    for p in paths:
        tokens.write_parquet(p)
    size = paths[0].stat().st_size
    monkeypatch.setenv("DRIFT_MAX_UPLOAD_MB", str(1.5 * size / access.MiB))  # one file fits, two do not
    at = app(monkeypatch, db)
    at.switch_page("pages/data.py").run()
    uploader = at.get("file_uploader")[0]
    uploader.set_value([(p.name, p.read_bytes(), "application/octet-stream") for p in paths]).run()
    assert at.button(key="data_load").disabled
    assert any("The upload holds 2 files" in e and "DRIFT_MAX_UPLOAD_MB" in e for e in errors(at)), errors(at)
    assert "capped" not in at.multiselect(key="sidebar_runs").options

    at.get("file_uploader")[0].set_value([(paths[0].name, paths[0].read_bytes(), "application/octet-stream")]).run()
    assert not errors(at) and not at.button(key="data_load").disabled
    at.button(key="data_load").click().run()
    assert not at.exception and not errors(at), errors(at)
    assert "capped" in at.multiselect(key="sidebar_runs").options


# -- DuckDB settings from the environment ----------------------------------------------------------------
@pytest.mark.parametrize("read_only", [False, True])
def test_store_takes_memory_limit_and_threads_from_env(monkeypatch, db, read_only):
    from analysis.store import Store

    monkeypatch.setenv("DRIFT_MEMORY_LIMIT", "256MiB")
    monkeypatch.setenv("DRIFT_THREADS", "1")
    with Store(db, read_only=read_only) as store:
        assert store.scalar("SELECT current_setting('memory_limit')") == "256.0 MiB"
        assert store.scalar("SELECT current_setting('threads')") == 1
    monkeypatch.setenv("DRIFT_MEMORY_LIMIT", "1GiB")
    monkeypatch.setenv("DRIFT_THREADS", "2")
    with Store(db, read_only=read_only) as store:
        assert store.scalar("SELECT current_setting('memory_limit')") == "1.0 GiB"
        assert store.scalar("SELECT current_setting('threads')") == 2


# -- a real server and a fake identity provider ---------------------------------------------------------
class FakeIdP:
    """The smallest OpenID Connect provider st.login can use: discovery, an authorize endpoint that approves at
    once (as whoever `claims` says), a token endpoint issuing an RS256-signed id_token, and its JWKS."""

    def __init__(self, client_id: str):
        from http.server import ThreadingHTTPServer

        from joserfc.jwk import RSAKey  # Authlib's JOSE library
        self.key = RSAKey.generate_key(2048, parameters={"kid": "test-key"}, private=True)
        self.client_id, self.claims, self.nonces = client_id, {}, {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeIdP":
        import threading
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()

    def _handler(self):
        import json
        from http.server import BaseHTTPRequestHandler
        from urllib.parse import parse_qsl, urlencode, urlsplit

        from joserfc import jwt
        idp = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj: dict | None = None, location: str | None = None) -> None:
                body = json.dumps(obj or {}).encode()
                self.send_response(code)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                url = urlsplit(self.path)
                q = dict(parse_qsl(url.query))
                u = idp.url
                if url.path == "/.well-known/openid-configuration":
                    self._send(200, {"issuer": u, "authorization_endpoint": f"{u}/authorize",
                                     "token_endpoint": f"{u}/token", "jwks_uri": f"{u}/jwks",
                                     "response_types_supported": ["code"], "subject_types_supported": ["public"],
                                     "id_token_signing_alg_values_supported": ["RS256"],
                                     "code_challenge_methods_supported": ["S256"]})
                elif url.path == "/jwks":
                    self._send(200, {"keys": [idp.key.as_dict(private=False) | {"use": "sig", "alg": "RS256"}]})
                elif url.path == "/authorize":
                    code = f"code-{len(idp.nonces)}"
                    idp.nonces[code] = q.get("nonce", "")
                    self._send(302, location=q["redirect_uri"] + "?" + urlencode({"code": code, "state": q["state"]}))
                else:
                    self._send(404)

            def do_POST(self):  # /token
                form = dict(parse_qsl(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()))
                nonce = idp.nonces.pop(form.get("code", ""), None)
                if nonce is None:
                    return self._send(400, {"error": "invalid_grant"})
                now = int(time.time())
                claims = {"iss": idp.url, "sub": "user-1", "aud": idp.client_id, "iat": now, "exp": now + 600,
                          "nonce": nonce, **idp.claims}
                self._send(200, {"access_token": "test-access", "token_type": "Bearer", "expires_in": 600,
                                 "id_token": jwt.encode({"alg": "RS256", "kid": "test-key"}, claims, idp.key)})
        return Handler


@pytest.mark.browser
@pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")
def test_sign_in_flow_in_a_real_server(app_template_db, tmp_path):
    """st.login against a fake OIDC provider, in Chromium. First, the very first request a fresh server gets is for
    a page URL: Streamlit would run pages/data.py on its own there (its pages/ folder routing, before any
    st.navigation), skipping app.py; ui/auth.ensure_routed_through_app must send it through the gate. Then an
    account outside DRIFT_ALLOWED_DOMAIN is refused, an allowed one gets in, and logging out closes the app again."""
    import os

    from playwright.sync_api import sync_playwright

    db = tmp_path / "drift.duckdb"
    shutil.copy(app_template_db, db)
    port = bu.free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with FakeIdP("test-client") as idp:
        secrets = tmp_path / "secrets.toml"
        secrets.write_text("[auth]\n" + "".join(f'{k} = "{v}"\n' for k, v in (AUTH | {
            "redirect_uri": f"{url}/oauth2callback", "cookie_secret": "a-test-cookie-secret-of-32-chars!",
            "server_metadata_url": f"{idp.url}/.well-known/openid-configuration"}).items()))
        env = os.environ | {"DRIFT_DB": str(db), "DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0",
                            "DRIFT_ALLOWED_DOMAIN": "example.org"}
        cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
               "--server.address", "127.0.0.1", "--secrets.files", str(secrets)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=bu.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    with urllib.request.urlopen(url + "/_stcore/health", timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, "server did not start"
                    time.sleep(0.3)
            with sync_playwright() as p:
                browser = bu.launch_chromium(p)
                try:
                    page = browser.new_page()
                    sign_in = page.get_by_role("button", name="Sign in")

                    def signed_out():
                        sign_in.wait_for(timeout=60_000)
                        bu.wait_idle(page, "Driftscope")
                        assert page.locator("h1").all_inner_texts() == ["Driftscope"]
                        assert page.locator("[data-testid='stFileUploader']").count() == 0
                        assert page.locator("[data-testid='stSidebarNav']").count() == 0  # no page links either

                    page.goto(url + "/data")  # the very first request this server sees
                    signed_out()

                    idp.claims = {"email": "eve@elsewhere.net", "name": "Eve", "email_verified": True}
                    sign_in.click()
                    page.get_by_text("is not allowed to use this Driftscope").wait_for(timeout=60_000)
                    assert page.locator("div.drift-chart").count() == 0
                    page.get_by_role("button", name="Sign out").click()
                    signed_out()

                    idp.claims = {"email": "ann@example.org", "name": "Ann", "email_verified": True}
                    sign_in.click()
                    bu.wait_idle(page, "Overview")
                    assert "Signed in as Ann" in page.locator("[data-testid='stSidebar']").inner_text()
                    bu.goto_page(page, "Data", "Data")
                    assert page.locator("[data-testid='stFileUploader']").count() == 1
                    page.get_by_role("button", name="Log out").click()
                    signed_out()
                finally:
                    browser.close()
        finally:
            proc.terminate()
            proc.wait(15)
    assert "Traceback" not in log.read_text(errors="replace")


@pytest.mark.slow
def test_viewer_on_a_new_database_holds_it_read_only(tmp_path, monkeypatch):
    """A viewer started on a database that does not exist yet creates it with the demo, then holds it read-only."""
    import duckdb
    from ui import state

    db = tmp_path / "new.duckdb"
    state._open.clear()
    try:
        app = state._open(str(db), True, True)
        assert app.store.read_only and app.store.run_names()  # demo runs are there
        with pytest.raises(duckdb.Error):
            app.store.cursor().execute("DELETE FROM runs")
    finally:
        state._open.clear()
