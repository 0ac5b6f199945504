"""Optional sign-in for hosted use: st.login (OpenID Connect) gates the whole app when the secrets have an [auth]
section; DRIFT_ALLOWED_EMAILS / DRIFT_ALLOWED_DOMAIN then restrict who gets in after signing in."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import streamlit as st

from analysis import settings

# What st.login needs in [auth] (or in each [auth.<provider>] for the last three), per the st.login docs.
SHARED_KEYS = ("redirect_uri", "cookie_secret")
PROVIDER_KEYS = ("client_id", "client_secret", "server_metadata_url")


class AuthConfigError(Exception):
    """The sign-in settings exist but cannot be used: the app refuses to open rather than open unguarded."""


# -- who may get in (pure) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AllowList:
    emails: frozenset[str] = frozenset()
    domains: frozenset[str] = frozenset()

    @property
    def restricts(self) -> bool:
        return bool(self.emails or self.domains)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "AllowList":
        """DRIFT_ALLOWED_EMAILS="a@x.org, b@y.com", DRIFT_ALLOWED_DOMAIN="x.org" (both comma-separated, any case)."""
        def items(setting: settings.Setting) -> frozenset[str]:
            return frozenset(p.lower().lstrip("@") for p in setting.read(environ))
        return cls(items(settings.ALLOWED_EMAILS), items(settings.ALLOWED_DOMAIN))

    def admits(self, user: Mapping) -> bool:
        """True when the signed-in `user` (st.user's claims) may use the app.

        No list set: everyone the identity provider signs in. Otherwise the `email` claim must be listed, or end in
        `@<domain>` for a listed domain (exactly: `evil-x.org` and `x.org.evil.com` do not match `x.org`). An
        email the provider marks `email_verified: false` never matches, since some providers let users type it.

        >>> AllowList(domains=frozenset({"x.org"})).admits({"email": "Ann@X.org", "email_verified": True})
        True
        >>> AllowList(domains=frozenset({"x.org"})).admits({"email": "ann@evil-x.org"})
        False
        """
        if not self.restricts:
            return True
        email = str(user.get("email") or "").strip().lower()
        if not email or user.get("email_verified") is False or email.count("@") != 1:
            return False
        return email in self.emails or email.rsplit("@", 1)[1] in self.domains


# -- the [auth] secrets --------------------------------------------------------------------------------
def _secrets_file_exists() -> bool:
    from streamlit import config
    return any(Path(p).exists() for p in config.get_option("secrets.files"))


def auth_settings() -> Mapping | None:
    """The [auth] section of the secrets, or None when there is none (no secrets file at all is the common case).

    Raises AuthConfigError when a secrets file exists but cannot be parsed, or [auth] lacks a key st.login needs:
    a broken sign-in must keep the app closed, never open it to everyone."""
    try:
        section = st.secrets.get("auth")
    except FileNotFoundError:  # StreamlitSecretNotFoundError: no file, or a file that does not parse
        if _secrets_file_exists():
            raise AuthConfigError("a secrets file exists but cannot be parsed (see the server log)") from None
        return None
    if not section:
        return None
    if not isinstance(section, Mapping):
        raise AuthConfigError("[auth] in the secrets must be a table")
    missing = [k for k in SHARED_KEYS if not section.get(k)]
    providers = provider_names(section)
    if not providers:
        missing += [k for k in PROVIDER_KEYS if not section.get(k)]
    for name in providers:
        if name != "default":
            missing += [f"{name}.{k}" for k in PROVIDER_KEYS if not section[name].get(k)]
    if missing:
        raise AuthConfigError(f"[auth] in the secrets lacks {', '.join(missing)} (see .streamlit/secrets.example.toml)")
    if _holds_placeholder(section):
        raise AuthConfigError("[auth] in the secrets still holds the example's REPLACE-… placeholders")
    return section


def _holds_placeholder(section: Mapping) -> bool:
    return any(_holds_placeholder(v) if isinstance(v, Mapping) else str(v).startswith("REPLACE-")
               for v in section.values())


def provider_names(section: Mapping) -> list[str]:
    """'default' when [auth] itself holds client_id; plus every [auth.<name>] sub-table (client_kwargs is options)."""
    names = ["default"] if section.get("client_id") else []
    return names + [k for k, v in section.items() if isinstance(v, Mapping) and k != "client_kwargs"]


def _user() -> dict:
    try:
        return dict(st.user.to_dict())
    except Exception:  # no session context (bare import): nobody is signed in
        return {}


def access_granted() -> bool:
    """True when the app may draw its pages for this session (no sign-in configured, or signed in and allowed)."""
    try:
        settings = auth_settings()
    except AuthConfigError:
        return False
    if settings is None:
        return not AllowList.from_env().restricts
    user = _user()
    return bool(user.get("is_logged_in")) and AllowList.from_env().admits(user)


# -- the gate --------------------------------------------------------------------------------------------
def md_escape(text: str) -> str:
    """User text for st.markdown with its markup characters shown as text, never taking effect."""
    return re.sub(r"([\\`*_{}\[\]()#+\-.!<>|~$])", r"\\\1", text)


def require_login() -> None:
    """Call from app.py before any page: shows the sign-in screen and stops the run until the user may see the app;
    once signed in, puts the user's name and a logout button in the sidebar."""
    allow = AllowList.from_env()
    try:
        settings = auth_settings()
    except AuthConfigError as e:
        st.error(f"Sign-in is misconfigured: {e}. The app stays closed until this is fixed.", icon=":material/lock:")
        st.stop()
    if settings is None:
        if allow.restricts:  # the host asked for an allow-list but gave no way to sign in: stay closed
            st.error("DRIFT_ALLOWED_EMAILS / DRIFT_ALLOWED_DOMAIN is set but the secrets have no [auth] section, so "
                     "nobody can sign in. Add [auth] (see .streamlit/secrets.example.toml) or unset the allow-list.",
                     icon=":material/lock:")
            st.stop()
        return
    user = _user()
    if not user.get("is_logged_in"):
        _sign_in_screen(provider_names(settings))
        st.stop()
    name = str(user.get("name") or user.get("email") or "signed-in user")
    if not allow.admits(user):
        st.title("Driftscope")
        st.error(f"{md_escape(str(user.get('email') or name))} is not allowed to use this Driftscope. Sign out and "
                 "use another account, or ask the host to add you.", icon=":material/block:")
        if st.button("Sign out", key="auth_denied_logout"):
            st.logout()
        st.stop()
    with st.sidebar:
        c1, c2 = st.columns([3, 2], vertical_alignment="center")
        c1.caption(f"Signed in as **{md_escape(name)}**")
        if c2.button("Log out", key="auth_logout", icon=":material/logout:"):
            st.logout()  # the browser is sent to /auth/logout; draw nothing more for this session
            st.stop()


def _sign_in_screen(providers: list[str]) -> None:
    from streamlit.auth_util import is_authlib_installed

    st.title("Driftscope")
    st.markdown("Sampler/trainer log-prob drift for RL runs. **Sign in to continue.**")
    if not is_authlib_installed():
        st.error("Sign-in needs the Authlib package on the server: `pip install Authlib` (see requirements.txt).")
        return
    for provider in providers:
        label = "Sign in" if provider == "default" else f"Sign in with {provider.replace('_', ' ').title()}"
        if st.button(label, type="primary", key=f"auth_login_{provider}", icon=":material/login:"):
            st.login(None if provider == "default" else provider)


# -- every run goes through app.py -----------------------------------------------------------------------
def ensure_routed_through_app() -> None:
    """Close the pages/ folder's own routing (Streamlit's multipage v1) before it can bypass app.py.

    Streamlit turns v1 routing off only when st.navigation runs. Until then, the first request a fresh server
    gets for a page URL (e.g. /data) runs pages/data.py on its own: no sign-in gate, no shared sidebar. Every
    page calls this first (tests/test_tree.py checks that each does): it switches v1 off as st.navigation
    would, and, when app.py is not on the stack, reruns so the request goes through app.py. Pinned by a browser
    test in tests/test_hosted.py (a Streamlit upgrade that changes this shows up there).
    """
    try:
        from streamlit.runtime.pages_manager import PagesManager
        from streamlit.runtime.scriptrunner import get_script_run_ctx
    except ImportError:  # pragma: no cover - a Streamlit without these internals has no v1 routing to close
        return
    ctx = get_script_run_ctx(suppress_warning=True)
    if ctx is None or not PagesManager.uses_pages_directory:
        return
    PagesManager.uses_pages_directory = False
    main = Path(ctx.main_script_path).resolve()
    frame = sys._getframe(1)
    while frame is not None:
        if Path(frame.f_globals.get("__file__") or "-").resolve() == main:
            return
        frame = frame.f_back
    st.rerun()
