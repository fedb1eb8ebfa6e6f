"""The dashboard in headless Chromium against a real controller and a real agent (fake GPUs):
the overview, a GPU, the queue, switching a GPU's mode and releasing a lease, as an operator
would click them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import AUTH
from tests.ports import free_port as _free_port
from tests.timing import scaled

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("GPUPOOL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NODE = "browser-node"


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set GPUPOOL_CHROMIUM)"
    return None


if (_missing := _browser_missing()) is not None:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

ACTION_TIMEOUT_MS = scaled(15.0) * 1000
"""How long a click or fill waits for its element, and (EXPECT_TIMEOUT_MS) an assertion for
what it shows: stretched by the suite's slowdown, since a loaded machine renders slowly (a
toast's 5 s default ran out under load)."""
EXPECT_TIMEOUT_MS = scaled(10.0) * 1000
expect.set_options(timeout=EXPECT_TIMEOUT_MS)


@dataclass
class LivePool:
    url: str
    api: httpx.Client
    tokens: dict[str, str]
    """Tokens by role, made for the browser: admin (named browser-test) and viewer."""

    def gpus(self) -> list[dict[str, Any]]:
        return list(self.api.get("/gpus").json())

    def lease(self, **body: Any) -> dict[str, Any]:
        response = self.api.post("/leases", json={"ttl_s": 600, **body})
        assert response.status_code == 201, response.text
        return dict(response.json())


def _wait(
    check: Any, what: str, timeout_s: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> Any:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}")
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePool]:
    work = tmp_path_factory.mktemp("dashboard-browser")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    gpupool = [sys.executable, "-m", "gpupool.cli"]
    logs = [(work / "controller.log").open("wb"), (work / "agent.log").open("wb")]
    controller = subprocess.Popen(
        [
            *gpupool,
            "controller",
            "--port",
            str(port),
            "--data-dir",
            str(work / "ctl"),
            "--lease-ttl",
            "600",
        ],
        stdout=logs[0],
        stderr=subprocess.STDOUT,
    )
    agent: subprocess.Popen[bytes] | None = None
    try:
        _wait(
            lambda: httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200,
            "controller",
            proc=controller,
        )
        argv = [*gpupool, "agent", "--url", url, "--fake", "2xH100-80GB", "--node", NODE]
        argv += ["--interval", "0.5", "--data-dir", str(work / "agent")]
        agent = subprocess.Popen(
            argv,
            stdout=logs[1],
            stderr=subprocess.STDOUT,
        )
        with httpx.Client(base_url=f"{url}/api/v1", timeout=10, headers=AUTH) as api:
            _wait(lambda: len(api.get("/gpus").json()) == 2, "the agent's GPUs", proc=agent)
            tokens = {
                role: api.post("/tokens", json={"name": name, "role": role}).json()["token"]
                for role, name in (("admin", "browser-test"), ("viewer", "watcher"))
            }
            yield LivePool(url, api, tokens)
    finally:
        for proc in (agent, controller):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=scaled(15))
                except subprocess.TimeoutExpired:
                    proc.kill()
        for log in logs:
            log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def sign_in(page: Page, pool: LivePool, role: str) -> None:
    """What an operator does: open the dashboard, paste a token, sign in."""
    page.goto(pool.url + "/")
    page.locator("[data-testid=signin-token]").fill(pool.tokens[role])
    page.locator("#signin-ok").click()
    expect(page.locator("#signin")).to_be_hidden()


@pytest.fixture
def anonymous_page(browser: Browser) -> Iterator[Page]:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(ACTION_TIMEOUT_MS)
    yield page
    page.close()


@pytest.fixture
def page(browser: Browser, pool: LivePool) -> Iterator[Page]:
    """A page signed in with the admin token named browser-test."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    host = pool.url.split("//", 1)[1].split(":")[0]
    page.context.add_cookies(
        [
            {
                "name": "gpupool_session",
                "value": pool.tokens["admin"],
                "domain": host,
                "path": "/",
                "httpOnly": True,
                "sameSite": "Strict",
            }
        ]
    )
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(ACTION_TIMEOUT_MS)
    yield page
    page.close()
    assert errors == [], f"the page threw: {errors}"


def free_gpu(pool: LivePool) -> dict[str, Any]:
    return next(g for g in pool.gpus() if not g["leases"] and g["mode"] == "virtual")


def test_overview_shows_the_pool_and_follows_it_without_a_reload(
    pool: LivePool, page: Page
) -> None:
    page.goto(pool.url + "/")
    expect(page.locator("[data-testid=gpu-tile]")).to_have_count(2)
    expect(page.locator("[data-testid=kpi-gpus] .value")).to_have_text("2")
    expect(page.locator("#simulated")).to_be_visible()
    holding = int(page.locator("[data-testid=kpi-leases] .value").inner_text())
    pool.lease(compute_pct=10, memory="1GiB", holder="live-update-check")
    # The page polls; the new lease shows up with no navigation.
    expect(page.locator("[data-testid=kpi-leases] .value")).to_have_text(
        str(holding + 1), timeout=EXPECT_TIMEOUT_MS
    )
    expect(page.locator("#live")).to_have_class("live ok")


def test_gpu_page_draws_the_slices_and_names_their_holders(pool: LivePool, page: Page) -> None:
    lease = pool.lease(compute_pct=30, memory="8GiB", holder="alice@notebook")
    uuid = lease["slices"][0]["gpu_uuid"]
    page.goto(pool.url + "/")
    page.locator(f"[data-testid=gpu-tile][href='#/gpus/{uuid}']").click()
    expect(page.locator("#title")).to_contain_text(f"{NODE}/")
    row = page.locator("[data-testid=holder-row]", has_text=lease["id"])
    expect(row).to_contain_text("alice@notebook")
    expect(row).to_contain_text("30%")
    expect(page.locator("[data-testid=compute-bar] [data-testid=slice]").first).to_be_visible()
    expect(page.locator("[data-testid=memory-bar]")).to_contain_text("free")


def test_queue_page_lists_waiting_requests_with_their_reason(pool: LivePool, page: Page) -> None:
    waiting = pool.lease(physical=True, holder="needs-a-whole-gpu")
    assert waiting["state"] == "queued"
    page.goto(pool.url + "/#/queue")
    row = page.locator("[data-testid=queue-row]", has_text=waiting["id"])
    expect(row).to_contain_text("physical GPUs")
    expect(row).to_contain_text("needs-a-whole-gpu")
    expect(page.locator("#nav-queue")).not_to_have_text("")
    pool.api.post(f"/leases/{waiting['id']}/release")


def test_gpu_actions_wait_for_the_gpu_state(pool: LivePool, page: Page) -> None:
    # A click before the GPU's state arrived used to do nothing (the buttons were enabled
    # from the start); seen as a flaky test on a loaded machine.
    gpu = free_gpu(pool)
    held: list[Any] = []
    page.route("**/api/v1/dashboard/gpus/*", lambda route: held.append(route))
    page.goto(f"{pool.url}/#/gpus/{gpu['uuid']}")
    switch = page.locator("[data-action=mode-physical]")
    for _ in range(100):  # wait for the page's request (held above), at most 5 s
        if held:
            break
        page.wait_for_timeout(50)
    assert held, "the page asked for the GPU's state"
    expect(switch).to_be_disabled()
    expect(page.locator("[data-action=isolate]")).to_be_disabled()
    for route in held:
        route.continue_()
    page.unroute("**/api/v1/dashboard/gpus/*")
    expect(switch).to_be_enabled()
    expect(page.locator("[data-action=clear]")).to_be_disabled()  # not isolated


def test_a_page_left_while_it_loaded_does_not_draw_over_the_next(
    pool: LivePool, page: Page
) -> None:
    # Seen as a flaky test: sign-in routes twice (the hash change, then boot once the chrome
    # loads). The first GPU view's late answer enabled the second view's buttons before that
    # view had its GPU, so a click on them did nothing.
    first, second = pool.gpus()[:2]
    held: list[Any] = []
    first_url = f"**/api/v1/dashboard/gpus/{first['uuid']}"
    page.route(first_url, lambda route: held.append(route))
    page.goto(f"{pool.url}/#/gpus/{first['uuid']}")
    for _ in range(100):  # the handler runs while Playwright waits: at most 5 s
        if held:
            break
        page.wait_for_timeout(50)
    assert len(held) == 1, "the first page asked for its GPU's state"
    page.goto(f"{pool.url}/#/gpus/{second['uuid']}")
    name = page.locator("#gpu-name")
    expect(name).to_contain_text(f"{second['node']}/{second['index']}")
    # Every text the page writes into the name from now on is kept.
    page.evaluate(
        """() => { window.names = [];
          const el = document.querySelector("#gpu-name");
          new MutationObserver(() => window.names.push(el.textContent))
            .observe(el, {childList: true, subtree: true, characterData: true}); }"""
    )
    with page.expect_response(
        lambda r: first["uuid"] in r.url and "/dashboard/gpus/" in r.url
    ) as late:
        held[0].continue_()
    late.value.finished()
    page.unroute(first_url)
    # The page shown refreshes itself (every 3 s) after the late answer came: its scripts
    # have run past that answer by the time this refresh's answer is in, and once it is drawn
    # (the response arrives before the script draws it) the name has been written again.
    with page.expect_response(lambda r: second["uuid"] in r.url and "/dashboard/gpus/" in r.url):
        pass
    page.wait_for_function("() => window.names.length > 0")
    written = page.evaluate("() => window.names")
    assert written and not [w for w in written if f"{first['node']}/{first['index']} " in w], (
        written
    )
    expect(name).to_contain_text(f"{second['node']}/{second['index']}")
    expect(page.locator("#gpu-model")).to_contain_text(second["uuid"])


def test_switching_a_gpu_mode_asks_first_and_records_the_operator(
    pool: LivePool, page: Page
) -> None:
    gpu = free_gpu(pool)
    page.goto(f"{pool.url}/#/gpus/{gpu['uuid']}")
    switch = page.locator("[data-action=mode-physical]")
    expect(switch).to_be_enabled()
    switch.click()
    expect(page.locator("#dialog")).to_be_visible()
    page.locator("#dialog-cancel").click()
    expect(page.locator("#dialog")).to_be_hidden()
    assert pool.api.get(f"/gpus/{gpu['uuid']}").json()["mode"] == "virtual"  # cancelled: no change

    waiting = pool.lease(physical=True, holder="profiler-run")
    switch.click()
    expect(page.locator("#dialog-actor")).to_have_text("admin:browser-test")
    page.locator("#dialog-ok").click()
    expect(page.locator("#dialog")).to_be_hidden()
    expect(page.locator("#gpu-name")).to_contain_text("physical", timeout=EXPECT_TIMEOUT_MS)
    assert pool.api.get(f"/gpus/{gpu['uuid']}").json()["mode"] == "physical"
    events = pool.api.get("/events", params={"subject": gpu["uuid"], "kind": "gpu.mode"}).json()
    assert events[-1]["actor"] == "admin:browser-test"
    # The waiting whole-GPU request gets the GPU at once.
    assert pool.api.get(f"/leases/{waiting['id']}").json()["state"] == "granted"
    pool.api.post(f"/leases/{waiting['id']}/release")
    pool.api.post(f"/gpus/{gpu['uuid']}/mode", json={"mode": "virtual"})


def test_releasing_a_lease_from_the_leases_page(pool: LivePool, page: Page) -> None:
    lease = pool.lease(compute_pct=20, memory="2GiB", holder="forgotten-notebook")
    page.goto(pool.url + "/#/leases")
    row = page.locator("[data-testid=lease-row]", has_text=lease["id"])
    expect(row).to_contain_text("forgotten-notebook")
    row.locator("[data-release]").click()
    expect(page.locator("#dialog-title")).to_contain_text(lease["id"])
    expect(page.locator("#dialog-actor")).to_have_text("admin:browser-test")
    page.locator("#dialog-ok").click()
    expect(page.locator(".toast")).to_contain_text("released")
    after = pool.api.get(f"/leases/{lease['id']}").json()
    assert (after["state"], after["release_reason"]) == ("released", "released by an operator")
    expect(page.locator("[data-testid=lease-row]", has_text=lease["id"])).to_have_count(0)
    [event] = [
        e
        for e in pool.api.get("/events", params={"subject": lease["id"]}).json()
        if e["kind"] == "lease.released"
    ]
    assert event["actor"] == "admin:browser-test"


def test_editing_a_quota_asks_first_and_saves_it(pool: LivePool, page: Page) -> None:
    pool.api.post("/tenants", json={"name": "ui-team"})
    page.goto(pool.url + "/#/tenants")
    page.locator("[data-quota='ui-team']").click()
    page.locator("input[name=max_compute_pct]").fill("150")
    page.locator("input[name=max_memory]").fill("40GiB")
    page.locator("#dialog-ok").click()
    expect(page.locator("[data-testid=tenant-row]", has_text="ui-team")).to_contain_text("150%")
    tenant = pool.api.get("/tenants/ui-team").json()
    assert (tenant["max_compute_pct"], tenant["max_memory_mib"]) == (150, 40 * 1024)


def test_signing_in_takes_a_valid_token_only(pool: LivePool, anonymous_page: Page) -> None:
    page = anonymous_page
    page.goto(pool.url + "/")
    expect(page.locator("#signin")).to_be_visible()
    page.locator("[data-testid=signin-token]").fill("gpp_000000000000_not-a-real-secret")
    page.locator("#signin-ok").click()
    expect(page.locator("#signin-error")).to_contain_text("not valid")
    sign_in(page, pool, "admin")
    expect(page.locator("#actor-name")).to_have_text("browser-test")
    expect(page.locator("[data-testid=gpu-tile]")).to_have_count(2)
    # The token is in an HttpOnly cookie: page scripts cannot read it.
    assert page.evaluate("document.cookie") == ""


def test_a_viewer_sees_the_pool_but_cannot_change_it(pool: LivePool, anonymous_page: Page) -> None:
    page = anonymous_page
    gpu = free_gpu(pool)
    sign_in(page, pool, "viewer")
    expect(page.locator("#actor-role")).to_contain_text("viewer")
    page.goto(f"{pool.url}/#/gpus/{gpu['uuid']}")
    expect(page.locator("#gpu-name")).to_contain_text("virtual")
    page.locator("[data-action=mode-physical]").click()
    expect(page.locator(".toast.bad")).to_contain_text("need an admin token")
    expect(page.locator("#dialog")).to_be_hidden()
    # The controller is the real check: the viewer's cookie cannot switch the mode either.
    answer = page.evaluate(
        """async (uuid) => {
            const r = await fetch(`/api/v1/gpus/${uuid}/mode`, {method: "POST",
              headers: {"Content-Type": "application/json", "X-Gpupool-Csrf": "1"},
              body: JSON.stringify({mode: "physical"})});
            return [r.status, (await r.json()).detail];
        }""",
        gpu["uuid"],
    )
    assert answer[0] == 403 and "viewer" in answer[1]
    assert pool.api.get(f"/gpus/{gpu['uuid']}").json()["mode"] == "virtual"


def test_the_sign_in_form_shows_no_error_before_anything_is_typed(
    pool: LivePool, anonymous_page: Page
) -> None:
    page = anonymous_page
    page.goto(pool.url + "/")
    expect(page.locator("#signin")).to_be_visible()
    expect(page.locator("[data-testid=signin-token]")).to_be_focused()
    expect(page.locator("#signin-error")).to_be_hidden()


def test_the_rules_table_fits_a_1400_px_window(pool: LivePool, page: Page) -> None:
    page.goto(pool.url + "/#/alerts")
    table = page.locator("[data-testid=rules-table]")
    expect(table.locator("tbody tr").first).to_be_visible()
    wrap = page.locator("#rules")
    overflow = wrap.evaluate("el => el.scrollWidth - el.clientWidth")
    assert overflow <= 0, f"the rules table is {overflow} px wider than its panel"


def test_stranded_room_is_no_warning_while_nothing_waits_and_cards_keep_one_unit(
    pool: LivePool, page: Page
) -> None:
    for earlier in pool.api.get("/leases").json():  # this module's pool: start from empty
        pool.api.post(f"/leases/{earlier['id']}/release")
    # Two slices of 60 %: one on each GPU, so all the free compute sits beside a slice.
    made = [pool.lease(compute_pct=60, memory="1GiB", holder=f"frag-{i}") for i in range(2)]
    try:
        overview = pool.api.get("/dashboard/overview").json()
        assert overview["fragmentation"] > 0.5 and overview["queue_length"] == 0
        page.goto(pool.url + "/")
        frag = page.locator("[data-testid=kpi-frag]")
        expect(frag.locator(".note")).to_contain_text("nothing waits")
        assert "warn" not in (frag.get_attribute("class") or "")
        compute = page.locator("[data-testid=kpi-compute]")
        expect(compute.locator(".note")).to_contain_text("GPUs' compute")
        note = compute.locator(".note").inner_text()
        assert "% of" not in note, f"one unit per card: {note}"
    finally:
        for lease in made:
            pool.api.post(f"/leases/{lease['id']}/release")
