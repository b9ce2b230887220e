//! The dashboard of `tidemark serve` over real HTTP: pages answer with the tenant's data, the
//! login form sets the cookie, actions need `operate` and a same-origin POST, every value is
//! escaped; and the browser test: Debian's headless Chromium logs in, screenshots the overview
//! and retries a parked run with a click (skipped, saying why, when node, its modules or
//! /usr/bin/chromium are missing; `.ci/run` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use reqwest::blocking::{Client, Response};
use reqwest::redirect::Policy;
use serde_json::{json, Value};

use crate::server_api::write_config;
use crate::server_support::{token, Server};
use crate::support::{ok, skip};

const WAIT: Duration = Duration::from_secs(60);
const SCRIPT: &str = "<script>alert('pwned')</script>";

/// A browser-like client: no automatic redirects (the tests look at them), no cookie jar (the
/// tests send the cookie they were given).
fn client() -> Client {
    Client::builder().redirect(Policy::none()).timeout(Duration::from_secs(60)).build().unwrap()
}

/// Log in through the form; returns the `Cookie` header value to send.
pub(crate) fn login(server: &Server, token: &str) -> String {
    let response = client()
        .post(format!("{}/ui/login", server.base))
        .header("origin", &server.base)
        .form(&[("token", token)])
        .send()
        .unwrap();
    assert_eq!(response.status().as_u16(), 303);
    assert_eq!(response.headers()["location"], "/ui");
    let set = response.headers()["set-cookie"].to_str().unwrap().to_string();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/ui"] {
        assert!(set.contains(attribute), "{set}");
    }
    set.split(';').next().unwrap().to_string()
}

/// `GET path`: the status and the page, or for a redirect its `Location`.
fn get(server: &Server, path: &str, cookie: Option<&str>) -> (u16, String) {
    let mut request = client().get(format!("{}{path}", server.base));
    if let Some(cookie) = cookie {
        request = request.header("cookie", cookie);
    }
    answer(request.send().unwrap())
}

fn answer(response: Response) -> (u16, String) {
    let status = response.status().as_u16();
    let location = response.headers().get("location").map(|l| l.to_str().unwrap().to_string());
    (status, if status == 303 { location.unwrap_or_default() } else { response.text().unwrap() })
}

/// `GET path` as a logged-in browser: 200 and the page.
pub(crate) fn page(server: &Server, path: &str, cookie: &str) -> String {
    let (status, text) = get(server, path, Some(cookie));
    assert_eq!(status, 200, "GET {path}: {text}");
    text
}

/// A form POST as a browser on one of the dashboard's pages would send it.
fn post(
    server: &Server,
    path: &str,
    cookie: Option<&str>,
    origin: Option<&str>,
    form: &[(&str, &str)],
) -> (u16, String) {
    let mut request = client().post(format!("{}{path}", server.base)).form(form);
    if let Some(cookie) = cookie {
        request = request.header("cookie", cookie);
    }
    if let Some(origin) = origin {
        request = request.header("origin", origin);
    }
    answer(request.send().unwrap())
}

fn run_status(server: &Server, admin: &str, run_id: &str) -> Value {
    let (status, run) = server.call("GET", &format!("/v1/runs/{run_id}"), Some(admin), None);
    assert_eq!(status, 200, "{run}");
    run
}

fn wait_status(server: &Server, admin: &str, run_id: &str, wanted: &str) -> Value {
    server.wait_for(WAIT, |s| {
        let run = run_status(s, admin, run_id);
        (run["run"]["status"] == wanted).then_some(run)
    })
}

fn fast_workers(dir: &Path) -> String {
    write_config(dir, "[workers]\nmax_attempts = 2\nretry_delay_ms = 50\npoll_ms = 20\n")
}

/// An order saga parked for an operator: the payment service is down for both attempts of the
/// charge (`flaky_attempts` 2, `max_attempts` 2), so the saga compensates, and releasing the
/// inventory is refused for good (`fail: release_inventory`): the compensation gives up and the
/// run is `parked` (a dead letter).
fn parked_run(server: &Server, admin: &str, run_id: &str) -> Value {
    let t = Some(admin);
    let (status, body) = server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 100})));
    assert_eq!(status, 200, "{body}");
    let input = json!({"order_id": run_id, "sku": "sku-1", "quantity": 1, "amount": 700,
                       "flaky_attempts": 2, "fail": "release_inventory"});
    let (status, body) =
        server.call("POST", "/v1/runs", t, Some(&json!({"workflow": "order_saga", "run_id": run_id, "input": input})));
    assert_eq!(status, 201, "{body}");
    wait_status(server, admin, run_id, "parked")
}

/// The recorded attempts of the run's compensation of the reservation.
fn release_attempts(run: &Value) -> usize {
    let journal = run["journal"].as_array().unwrap();
    let seq = journal.iter().find(|e| e["name"] == "compensate:reserve_inventory").unwrap()["seq"].clone();
    run["attempts"].as_array().unwrap().iter().filter(|a| a["seq"] == seq).count()
}

#[test]
fn pages_show_the_tenants_state_and_escape_every_value() {
    crate::server_support::served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let server = Server::start(&data, &[], &[]);
        let t = Some(admin.as_str());

        // A flow applied by a consumer, a stream event its reservation handler cannot decode
        // (blocked), and a completed run whose input carries markup.
        server.call("PUT", "/v1/consumers/shipping", t, Some(&json!({"handler": "reservation"})));
        server.call(
            "POST",
            "/v1/flows/res-1/advance",
            t,
            Some(&json!({"expected_seq": 0, "to": "reserved", "quantity": 3})),
        );
        let (status, body) = server.call(
            "POST",
            "/v1/streams/notes/events",
            t,
            Some(&json!({"event_type": "note.added", "payload": {"text": SCRIPT}})),
        );
        assert_eq!(status, 200, "{body}");
        server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10})));
        let input = json!({"order_id": "order-1", "sku": "sku-1", "quantity": 2, "amount": 500, "note": SCRIPT});
        let (status, body) = server.call(
            "POST",
            "/v1/runs",
            t,
            Some(&json!({"workflow": "order_saga", "run_id": "order-1", "input": input})),
        );
        assert_eq!(status, 201, "{body}");
        wait_status(&server, &admin, "order-1", "completed");
        server.wait_for(WAIT, |s| {
            let (_, records) = s.call("GET", "/v1/consumers/shipping/inbox?status=blocked", t, None);
            (records["records"].as_array().map_or(0, Vec::len) == 1).then_some(())
        });

        // Not logged in: every page sends the browser to the login form; `/` goes to `/ui`.
        for path in ["/ui", "/ui/runs", "/ui/runs/order-1", "/ui/dead-letters"] {
            let (status, location) = get(&server, path, None);
            assert_eq!((status, location.as_str()), (303, "/ui/login"), "{path}");
        }
        let (status, location) = get(&server, "/", None);
        assert_eq!((status, location.as_str()), (303, "/ui"));
        let (status, text) = get(&server, "/ui/login", None);
        assert!(status == 200 && text.contains("name=\"token\""), "{text}");
        // A wrong token is refused on the form, and sets no cookie.
        let response = client()
            .post(format!("{}/ui/login", server.base))
            .header("origin", &server.base)
            .form(&[("token", "tmk_nope_nope")])
            .send()
            .unwrap();
        assert_eq!(response.status().as_u16(), 401);
        assert!(response.headers().get("set-cookie").is_none());

        let cookie = login(&server, &admin);
        let overview = page(&server, "/ui", &cookie);
        for expected in [
            "Outbox backlog",
            "Blocked inbox records",
            "Parked / failed runs",
            "Applies / s",
            "Runs completed / s",
            "<svg",
        ] {
            assert!(overview.contains(expected), "the overview lacks {expected:?}");
        }
        assert!(overview.contains("tenant <b>acme</b>"), "the header names the tenant");
        assert!(page(&server, "/ui/live", &cookie).starts_with("<div id=\"live\""));

        // The runs list and its filters.
        let runs = page(&server, "/ui/runs", &cookie);
        assert!(runs.contains("href=\"/ui/runs/order-1\""), "{runs}");
        assert!(page(&server, "/ui/runs?status=completed&workflow=order_saga", &cookie).contains("order-1"));
        assert!(!page(&server, "/ui/runs?status=parked", &cookie).contains("href=\"/ui/runs/order-1\""));
        assert!(
            !page(&server, "/ui/runs?created_before=2000-01-01T00%3A00", &cookie).contains("href=\"/ui/runs/order-1\"")
        );
        assert!(page(&server, "/ui/runs?created_after=2000-01-01T00%3A00&status=", &cookie).contains("order-1"));
        // Bad filters get the API's codes, as a page.
        let (status, text) = get(&server, "/ui/runs?status=sideways", Some(&cookie));
        assert!(status == 400 && text.contains("invalid_argument") && text.contains("unknown run status"), "{text}");
        let (status, text) = get(&server, "/ui/runs?created_after=yesterday", Some(&cookie));
        assert!(status == 400 && text.contains("invalid_argument"), "{text}");

        // The run's timeline: each step, its attempts; the input's markup is text, not markup.
        let run = page(&server, "/ui/runs/order-1", &cookie);
        for step in ["reserve_inventory", "charge_payment", "ship_order"] {
            assert!(run.contains(step), "the timeline lacks {step}");
        }
        assert!(run.contains("&lt;script&gt;alert('pwned')&lt;/script&gt;"), "{run}");
        assert!(!run.contains(SCRIPT), "a payload's <script> must render as text");
        let (status, text) = get(&server, "/ui/runs/nope", Some(&cookie));
        assert!(status == 404 && text.contains("not_found"), "{text}");

        // The flow: the producer's seq against the consumer's high-water mark; the blocked record
        // and its reason.
        let flow = page(&server, "/ui/flows/res-1", &cookie);
        assert!(flow.contains("High-water seq") && flow.contains("shipping"), "{flow}");
        let notes = page(&server, "/ui/flows/notes", &cookie);
        assert!(notes.contains("Blocked at seq 1"), "{notes}");
        let (status, location) = get(&server, "/ui/flows?flow_id=res-1", Some(&cookie));
        assert_eq!((status, location.as_str()), (303, "/ui/flows/res-1"));
        let (status, text) = get(&server, "/ui/flows?flow_id=%3Cb%3E", Some(&cookie));
        assert!(status == 400 && text.contains("invalid_id") && !text.contains("<b>"), "{text}");
        assert!(page(&server, "/ui/quarantine", &cookie).contains("Nothing is quarantined"));
        let dead = page(&server, "/ui/dead-letters", &cookie);
        assert!(dead.contains("note.added") && dead.contains("/ui/consumers/shipping/inbox/"), "{dead}");

        // The static files: versioned URLs, cached for a year.
        let css = overview.split("href=\"/ui/assets/dashboard.").nth(1).unwrap().split('"').next().unwrap();
        for asset in [format!("/ui/assets/dashboard.{css}"), "/ui/assets/htmx-2.0.11.min.js".to_string()] {
            let response = client().get(format!("{}{asset}", server.base)).send().unwrap();
            assert_eq!(response.status().as_u16(), 200, "{asset}");
            assert!(response.headers()["cache-control"].to_str().unwrap().contains("immutable"));
        }

        // A bearer header works for the pages as well (scripts, curl).
        let response = client().get(format!("{}/ui/runs", server.base)).bearer_auth(&admin).send().unwrap();
        assert_eq!(response.status().as_u16(), 200);

        // Skipping the blocked record from the page goes through the API's skip.
        let event_id =
            dead.split("/ui/consumers/shipping/inbox/").nth(1).unwrap().split('/').next().unwrap().to_string();
        let (status, location) = post(
            &server,
            &format!("/ui/consumers/shipping/inbox/{event_id}/skip"),
            Some(&cookie),
            Some(&server.base),
            &[("reason", "not for this consumer"), ("flow_id", "notes")],
        );
        assert_eq!((status, location.as_str()), (303, "/ui/flows/notes?done=record_skipped"));
        let (_, records) = server.call("GET", "/v1/consumers/shipping/inbox?status=skipped", t, None);
        assert_eq!(records["records"][0]["reason"], "skipped by operator: not for this consumer", "{records}");
        assert!(page(&server, "/ui/flows/notes?done=record_skipped", &cookie).contains("Record skipped"));

        // A revoked token's cookie no longer opens anything.
        let [flag, value] = crate::server_support::control(&data);
        let listed = ok(&["token", "list", &flag, &value]);
        let token_id = listed["tokens"][0]["token_id"].as_str().unwrap().to_string();
        ok(&["token", "revoke", &flag, &value, "--token-id", &token_id]);
        let (status, location) = get(&server, "/ui", Some(&cookie));
        assert_eq!((status, location.as_str()), (303, "/ui/login"));
    });
}

#[test]
fn actions_need_operate_and_a_same_origin_post() {
    crate::server_support::served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let reader = token(&data, "acme", "read");
        let other = token(&data, "globex", "admin");
        let server = Server::start(&data, &["--config", &fast_workers(dir.path())], &[]);
        let t = Some(admin.as_str());
        server.call("PUT", "/v1/stock/sku-1", t, Some(&json!({"quantity": 10})));
        let input = json!({"order_id": "slow-1", "sku": "sku-1", "quantity": 1, "amount": 5, "ship_after_ms": 600_000});
        server.call(
            "POST",
            "/v1/runs",
            t,
            Some(&json!({"workflow": "order_saga", "run_id": "slow-1", "input": input})),
        );
        wait_status(&server, &admin, "slow-1", "sleeping");
        let base = server.base.clone();
        let cancel = "/ui/runs/slow-1/cancel";
        let reason = [("reason", "from the test")];

        // A read token may look but not act: 403 with the API's code, and the run is untouched.
        let read_cookie = login(&server, &reader);
        assert!(page(&server, "/ui/runs/slow-1", &read_cookie).contains("slow-1"));
        assert!(!page(&server, "/ui/runs/slow-1", &read_cookie).contains("action=\"/ui/runs/slow-1/cancel\""));
        let (status, text) = post(&server, cancel, Some(&read_cookie), Some(&base), &reason);
        assert!(status == 403 && text.contains("forbidden") && text.contains("needs operate"), "{status} {text}");
        assert_eq!(run_status(&server, &admin, "slow-1")["run"]["cancel_requested"], false);

        // Another tenant's token does not see the run at all.
        let other_cookie = login(&server, &other);
        let (status, text) = get(&server, "/ui/runs/slow-1", Some(&other_cookie));
        assert_eq!(status, 404, "{text}");
        let (status, _) = post(&server, cancel, Some(&other_cookie), Some(&base), &reason);
        assert_eq!(status, 404);

        // CSRF: a POST without Origin/Referer, or from another site, is refused before anything.
        let cookie = login(&server, &admin);
        for origin in [None, Some("http://evil.example"), Some("null")] {
            let (status, text) = post(&server, cancel, Some(&cookie), origin, &reason);
            assert!(status == 403 && text.contains("cross-site request refused"), "{origin:?}: {status} {text}");
        }
        let (status, _) = post(&server, "/ui/login", None, Some("http://evil.example"), &[("token", admin.as_str())]);
        assert_eq!(status, 403, "login CSRF is refused too");
        assert_eq!(run_status(&server, &admin, "slow-1")["run"]["cancel_requested"], false);

        // The same validation as the API: an empty reason, a retry of a run that did not fail.
        let (status, text) = post(&server, cancel, Some(&cookie), Some(&base), &[("reason", "  ")]);
        assert!(status == 400 && text.contains("reason must be"), "{text}");
        let (status, text) = post(&server, "/ui/runs/slow-1/retry", Some(&cookie), Some(&base), &reason);
        assert!(status == 409 && text.contains("invalid_state_change"), "{text}");
        let (status, text) = post(
            &server,
            "/ui/runs/slow-1/fork",
            Some(&cookie),
            Some(&base),
            &[("from_step", "x"), ("new_run_id", "f")],
        );
        assert!(status == 400 && text.contains("invalid_argument"), "{text}");

        // A same-origin POST with operate: done, and the page says so.
        let (status, location) = post(&server, cancel, Some(&cookie), Some(&base), &reason);
        assert_eq!((status, location.as_str()), (303, "/ui/runs/slow-1?done=cancel_requested"));
        assert!(page(&server, &location, &cookie).contains("Cancel requested"));
        wait_status(&server, &admin, "slow-1", "cancelled");
        // Fork from the dashboard: a new run with the first step's journal.
        let (status, location) = post(
            &server,
            "/ui/runs/slow-1/fork",
            Some(&cookie),
            Some(&base),
            &[("from_step", "1"), ("new_run_id", "slow-2")],
        );
        assert_eq!((status, location.as_str()), (303, "/ui/runs/slow-2?done=forked"));
        assert_eq!(run_status(&server, &admin, "slow-2")["run"]["forked_from"], "slow-1");
        // Logging out clears the cookie.
        let (status, location) = post(&server, "/ui/logout", Some(&cookie), Some(&base), &[]);
        assert_eq!((status, location.as_str()), (303, "/ui/login"));
    });
}

#[test]
fn a_failed_run_retried_from_the_dashboard_completes() {
    crate::server_support::served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "operate");
        let stock = token(&data, "acme", "admin");
        let server = Server::start(&data, &["--config", &fast_workers(dir.path())], &[]);
        server.call("PUT", "/v1/stock/sku-1", Some(&stock), Some(&json!({"quantity": 10})));
        // The payment service is down for the first two calls and a step has two attempts: the
        // plain workflow fails; a retry's fresh attempt budget gets through.
        let input = json!({"order_id": "flaky-1", "sku": "sku-1", "quantity": 1, "amount": 5, "flaky_attempts": 2});
        let (status, body) = server.call(
            "POST",
            "/v1/runs",
            Some(&admin),
            Some(&json!({"workflow": "sleepy_order", "run_id": "flaky-1", "input": input})),
        );
        assert_eq!(status, 201, "{body}");
        wait_status(&server, &admin, "flaky-1", "failed");
        let cookie = login(&server, &admin);
        assert!(page(&server, "/ui/dead-letters", &cookie).contains("action=\"/ui/runs/flaky-1/retry\""));
        let (status, location) = post(
            &server,
            "/ui/runs/flaky-1/retry",
            Some(&cookie),
            Some(&server.base),
            &[("reason", "payments are back")],
        );
        assert_eq!((status, location.as_str()), (303, "/ui/runs/flaky-1?done=retried"));
        let run = wait_status(&server, &admin, "flaky-1", "completed");
        let charge = run["journal"].as_array().unwrap().iter().find(|e| e["name"] == "charge_payment").unwrap().clone();
        assert_eq!(charge["reason"], "operator retry: payments are back", "{run}");
    });
}

/// Where the browser test leaves its screenshots: `target/artifacts/` of the workspace.
fn artifact_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/artifacts")
}

#[test]
fn headless_chromium_logs_in_screenshots_and_retries_a_parked_run() {
    crate::server_support::served_on_both_backends(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let browser_dir = root.join("tests/browser");
        if Command::new("node").arg("--version").output().is_err() {
            return skip("browser test: node is not installed (.ci/run installs it)");
        }
        if !browser_dir.join("node_modules/playwright-core").exists() {
            return skip("browser test: tests/browser/node_modules is missing (run `npm ci` there; .ci/run does)");
        }
        if !Path::new("/usr/bin/chromium").exists() {
            return skip("browser test: /usr/bin/chromium is missing (apt-get install chromium; .ci/run does)");
        }
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let operator = token(&data, "acme", "operate");
        let server = Server::start(&data, &["--config", &fast_workers(dir.path())], &[]);
        let parked = parked_run(&server, &admin, "order-parked");
        assert!(parked["run"]["error"].as_str().unwrap().contains("compensation"), "{parked}");
        let attempts_before = release_attempts(&parked);

        // Some traffic for the overview's charts, spread over a few of the sampler's 2 s intervals:
        // events applied by a consumer, completed runs.
        let t = Some(admin.as_str());
        server.call("PUT", "/v1/consumers/audit", t, Some(&json!({"handler": "record"})));
        server.call("PUT", "/v1/stock/sku-2", t, Some(&json!({"quantity": 100})));
        for round in 0..6 {
            for i in 0..(4 + 3 * round) {
                let event = json!({"event_type": "note.added", "payload": {"n": i}});
                let (status, body) =
                    server.call("POST", &format!("/v1/streams/notes-{}/events", i % 4), t, Some(&event));
                assert_eq!(status, 200, "{body}");
            }
            let run = format!("ok-{round}");
            let input = json!({"order_id": run, "sku": "sku-2", "quantity": 1, "amount": 100});
            let start = json!({"workflow": "order_saga", "run_id": run, "input": input});
            assert_eq!(server.call("POST", "/v1/runs", t, Some(&start)).0, 201);
            std::thread::sleep(Duration::from_millis(1_000));
        }

        let artifacts = artifact_dir();
        let output = Command::new("node")
            .arg(browser_dir.join("dashboard.mjs"))
            .args([server.base.as_str(), operator.as_str(), "order-parked"])
            .arg(&artifacts)
            .output()
            .expect("run node");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "the browser test failed:\n{stdout}\n{stderr}");
        let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("one JSON line");
        assert_eq!(report["outcome"], "ok", "{report}");
        let screenshot = PathBuf::from(report["screenshot"].as_str().unwrap());
        assert!(std::fs::metadata(&screenshot).unwrap().len() > 10_000, "a real screenshot");
        eprintln!("dashboard screenshot: {}", screenshot.display());

        // Through the JSON API: the click retried the run. It left `parked` and the worker ran the
        // compensation that had given up again (one more recorded attempt); the release is refused
        // by the input for good, so the run parks again.
        let run = server.wait_for(WAIT, |s| {
            let run = run_status(s, &admin, "order-parked");
            (release_attempts(&run) > attempts_before && run["run"]["status"] == "parked").then_some(run)
        });
        let journal = run["journal"].as_array().unwrap();
        let release = journal.iter().find(|e| e["name"] == "compensate:reserve_inventory").unwrap();
        assert_eq!(release["reason"], "operator retry: retried from the dashboard", "{run}");
        assert!(run["run"]["updated_at_ms"].as_i64() > parked["run"]["updated_at_ms"].as_i64());
    });
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

#[test]
fn a_quarantined_delivery_is_dismissed_from_the_dashboard() {
    crate::server_support::served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let reader = token(&data, "acme", "read");
        let config = write_config(dir.path(), "[relay]\nmax_attempts = 1\n");
        let server = Server::start(&data, &["--config", &config], &[]);
        let t = Some(admin.as_str());
        // The consumer already holds another event at (acme, q-1, 1): the relay's delivery of the
        // real one is a `conflict`, never acknowledged, and with one attempt it is quarantined.
        server.call("PUT", "/v1/consumers/audit", t, Some(&json!({"handler": "record"})));
        let impostor = json!({"event_id": "impostor-1", "source": "acme", "generation": "g-other", "flow_id": "q-1",
        "seq": 1, "event_type": "note.added", "schema_version": 1, "payload": {"text": SCRIPT}, "created_at_ms": now_ms()});
        let (status, body) = server.call("POST", "/v1/consumers/audit/inbox", t, Some(&impostor));
        assert_eq!(status, 200, "{body}");
        let event = json!({"event_type": "note.added", "payload": {"text": "the real one"}});
        assert_eq!(server.call("POST", "/v1/streams/q-1/events", t, Some(&event)).0, 200);
        let delivery = server.wait_for(WAIT, |s| {
            let (_, page) = s.call("GET", "/v1/outbox?status=quarantined", t, None);
            page["deliveries"].as_array().and_then(|d| d.first().cloned())
        });
        let event_id = delivery["event_id"].as_str().unwrap();
        let resolve = format!("/ui/outbox/{event_id}/audit/resolve");

        // A reader sees it, without buttons; the overview counts it.
        let read_cookie = login(&server, &reader);
        let page_text = page(&server, "/ui/quarantine", &read_cookie);
        assert!(page_text.contains(event_id) && !page_text.contains(&resolve), "{page_text}");
        let (status, _) =
            post(&server, &resolve, Some(&read_cookie), Some(&server.base), &[("action", "dismiss"), ("reason", "x")]);
        assert_eq!(status, 403);

        let cookie = login(&server, &admin);
        assert!(page(&server, "/ui/quarantine", &cookie).contains(&format!("action=\"{resolve}\"")));
        let flow = page(&server, "/ui/flows/q-1", &cookie);
        assert!(flow.contains("Missing seqs") || flow.contains("High-water seq"), "{flow}");
        let (status, text) =
            post(&server, &resolve, Some(&cookie), Some(&server.base), &[("action", "drop"), ("reason", "x")]);
        assert!(status == 400 && text.contains("invalid_argument"), "an unknown action: {status} {text}");
        let (status, location) = post(
            &server,
            &resolve,
            Some(&cookie),
            Some(&server.base),
            &[("action", "dismiss"), ("reason", "the consumer holds an impostor")],
        );
        assert_eq!((status, location.as_str()), (303, "/ui/quarantine?done=dismiss"));
        assert!(page(&server, &location, &cookie).contains("Nothing is quarantined"));
        let (_, dismissed) = server.call("GET", "/v1/outbox?status=dismissed", t, None);
        assert_eq!(dismissed["deliveries"][0]["event_id"], event_id, "{dismissed}");
    });
}
