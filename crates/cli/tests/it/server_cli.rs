//! `tidemark --server URL --token T ...` against a real `tidemark serve`: the subcommands that
//! have a route send it (no file flags needed), print the server's JSON, and keep the exit codes
//! of the file mode (an answer exits 0, a 4xx exits 2 with the server's code, an unreachable
//! server exits 1). Also: progress lines on stderr when stderr is not a terminal.

use serde_json::{json, Value};

use crate::server_api::write_config;
use crate::server_fixture::{populate, CONFIG, WAIT};
use crate::server_support::{token, Server};
use crate::support::{run_with, Run};

/// `tidemark ARGS` with the server and token from the environment.
fn remote(server: &Server, token: &str, args: &[&str]) -> Run {
    run_with(args, &[("TIDEMARK_SERVER", &server.base), ("TIDEMARK_TOKEN", token)], None)
}

fn answered(r: Run) -> Value {
    r.assert_exit(0);
    r.json
}

fn refused(r: &Run, exit: i32, code: &str) {
    assert_eq!((r.code, r.json["error"]["code"].as_str()), (exit, Some(code)), "{}\n{}", r.stdout, r.stderr);
}

#[test]
fn subcommands_talk_to_a_running_server() {
    crate::server_support::served_on_both_backends(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let admin = token(&data, "acme", "admin");
        let reader = token(&data, "acme", "read");
        let server = Server::start(&data, &["--config", &write_config(dir.path(), CONFIG)], &[]);
        let fixture = populate(&server, &admin, "acme");
        let a = admin.as_str();

        // Flags instead of the environment; no --producer.
        let args = ["--server", &server.base, "--token", a, "advance", "--flow", "f1", "--expected-seq", "0", "--to"];
        let out = answered(run_with(&[&args[..], &["reserved", "--quantity", "2"]].concat(), &[], None));
        assert_eq!((out["outcome"].as_str(), out["seq"].as_i64()), (Some("committed"), Some(1)), "{out}");
        // A stale advance is an answer (HTTP 409 with an outcome): exit 0, as in the file mode.
        let stale = remote(
            &server,
            a,
            &["advance", "--flow", "f1", "--expected-seq", "0", "--to", "reserved", "--quantity", "2"],
        );
        assert_eq!((stale.code, stale.json["outcome"].as_str()), (0, Some("stale")), "{}", stale.stdout);
        let (_, flow) = server.call("GET", "/v1/flows/f1", Some(a), None);
        assert_eq!(flow["producer"]["last_seq"], 1, "the CLI's advance reached the server: {flow}");

        // Outbox: the quarantined delivery, listed and dismissed.
        let out = answered(remote(&server, a, &["outbox", "list", "--status", "quarantined"]));
        assert_eq!(out["outcome"], "listed");
        assert!(out["deliveries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["event_id"] == fixture.quarantined_event.as_str()));
        let resolve = [
            "outbox",
            "resolve",
            "--event",
            &fixture.quarantined_event,
            "--consumer-id",
            "mirror",
            "--action",
            "dismiss",
            "--reason",
            "forged on purpose",
        ];
        let out = answered(remote(&server, a, &resolve));
        assert_eq!(
            (out["outcome"].as_str(), out["delivery"]["status"].as_str()),
            (Some("resolved"), Some("dismissed"))
        );
        // Dismissing it again: 409 `invalid_state_change` from the server, exit 2 with that code.
        refused(&remote(&server, a, &resolve), 2, "invalid_state_change");
        // Redeliver: every event the outbox holds to audit again (a 200 with the counts); from one
        // event on; an unknown subscriber or event is 404 `not_found`, exit 2.
        let out = answered(remote(&server, a, &["outbox", "redeliver", "--consumer-id", "audit", "--all"]));
        assert_eq!(
            (out["outcome"].as_str(), out["consumer_id"].as_str()),
            (Some("redelivered"), Some("audit")),
            "{out}"
        );
        // At least res-1, notes, forged and f1; nothing pruned yet.
        assert!(out["redelivered"].as_u64().is_some_and(|n| n >= 4), "{out}");
        assert_eq!(out["pruned"], 0, "{out}");
        let from = ["outbox", "redeliver", "--consumer-id", "audit", "--from-event", &fixture.quarantined_event];
        let out = answered(remote(&server, a, &from));
        assert!(out["redelivered"].as_u64().is_some_and(|n| n >= 1), "{out}");
        refused(&remote(&server, a, &["outbox", "redeliver", "--consumer-id", "nobody", "--all"]), 2, "not_found");
        let unknown_event = ["outbox", "redeliver", "--consumer-id", "audit", "--from-event", "no-such-event"];
        refused(&remote(&server, a, &unknown_event), 2, "not_found");
        refused(&remote(&server, &reader, &["outbox", "redeliver", "--consumer-id", "audit", "--all"]), 2, "forbidden");

        // Inbox: the blocked record, listed and skipped; the consumer's cursors.
        let out = answered(remote(&server, a, &["inbox", "list", "--consumer-id", "ledger", "--status", "blocked"]));
        let records = out["records"].as_array().unwrap();
        assert!(records.iter().any(|r| r["envelope"]["event_id"] == fixture.blocked_event.as_str()), "{out}");
        let skip =
            ["inbox", "skip", "--consumer-id", "ledger", "--event", &fixture.blocked_event, "--reason", "not ours"];
        assert_eq!(answered(remote(&server, a, &skip))["outcome"], "skipped");
        let out = answered(remote(&server, a, &["inbox", "cursors", "--consumer-id", "ledger"]));
        assert!(out["cursors"].as_array().unwrap().iter().any(|c| c["flow_id"] == "res-1"), "{out}");

        // Workflows: start, show, list, and every operator control.
        answered(remote(&server, a, &["workflow", "seed-stock", "--sku", "sku-9", "--quantity", "5"]));
        let input = json!({"order_id": "cli-1", "sku": "sku-9", "quantity": 1, "amount": 10}).to_string();
        let start = ["workflow", "start", "--workflow", "order_saga", "--run-id", "cli-1", "--input", &input];
        assert_eq!(answered(remote(&server, a, &start))["outcome"], "started");
        assert_eq!(answered(remote(&server, a, &start))["outcome"], "existing");
        server.wait_for(WAIT, |_| {
            let out = answered(remote(&server, a, &["workflow", "show", "--run-id", "cli-1"]));
            (out["run"]["status"] == "completed").then_some(())
        });
        let out =
            answered(remote(&server, a, &["workflow", "list", "--workflow", "order_saga", "--status", "completed"]));
        let ids: Vec<&str> = out["runs"].as_array().unwrap().iter().map(|r| r["run_id"].as_str().unwrap()).collect();
        assert!(ids.contains(&"cli-1") && out["outcome"] == "listed", "{out}");
        let step = fixture.failed_step.to_string();
        let controls: [(&[&str], &str); 6] = [
            (&["workflow", "retry", "--run-id", "sleepy-fail", "--reason", "card updated"], "retried"),
            (
                &[
                    "workflow",
                    "skip",
                    "--run-id",
                    "sleepy-fail-2",
                    "--step",
                    &step,
                    "--output",
                    "{\"by\":\"phone\"}",
                    "--reason",
                    "paid",
                ],
                "skipped",
            ),
            (&["workflow", "abandon", "--run-id", "sleepy-wait-3", "--reason", "gave up"], "abandoned"),
            (&["workflow", "cancel", "--run-id", "sleepy-wait-2", "--reason", "customer asked"], "cancel_requested"),
            (&["workflow", "fork", "--run-id", "cli-1", "--from-step", "1", "--new-run-id", "cli-1-fork"], "forked"),
            (
                &[
                    "workflow",
                    "send-event",
                    "--run-id",
                    "sleepy-wait",
                    "--name",
                    "approval",
                    "--event-id",
                    "ok-1",
                    "--payload",
                    "{\"approved\":true}",
                ],
                "sent",
            ),
        ];
        for (args, outcome) in controls {
            assert_eq!(answered(remote(&server, a, args))["outcome"], outcome, "{args:?}");
        }
        server.wait_for(WAIT, |_| {
            let out = answered(remote(&server, a, &["workflow", "show", "--run-id", "sleepy-wait"]));
            (out["run"]["status"] == "completed").then_some(())
        });

        // Errors keep the server's code: 4xx exits 2, and bad input never leaves the machine.
        refused(&remote(&server, a, &["workflow", "show", "--run-id", "nope"]), 2, "not_found");
        refused(
            &remote(&server, &reader, &["workflow", "cancel", "--run-id", "cli-1", "--reason", "x"]),
            2,
            "forbidden",
        );
        refused(&remote(&server, "tmk_nope", &["workflow", "list"]), 2, "unauthenticated");
        refused(&remote(&server, a, &["workflow", "show", "--run-id", "bad id"]), 2, "invalid_id");
        refused(&remote(&server, a, &["inbox", "cursors"]), 2, "invalid_argument");
        refused(&remote(&server, a, &["relay", "--producer", "p.db"]), 2, "invalid_argument");
        let r = run_with(&["workflow", "show", "--run-id", "cli-1"], &[], None);
        refused(&r, 2, "invalid_argument");
        assert!(r.json["error"]["message"].as_str().unwrap().contains("--db"), "{}", r.stdout);

        // No server there: exit 1 (not the caller's fault), code `io`.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let r = run_with(&["--server", &url, "--token", a, "workflow", "list"], &[], None);
        refused(&r, 1, "io");
    });
}

#[test]
fn long_commands_print_plain_progress_lines_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_with(&["experiment", "--scenario", "duplicate_delivery"], &[], None);
    run.assert_exit(0);
    assert!(run.stderr.contains("tidemark experiment: 1/1 after"), "{}", run.stderr);
    assert!(run.stderr.contains("done: 1 scenarios"), "{}", run.stderr);
    // stdout is still one JSON document.
    assert_eq!(run.json["outcome"], "experiment");

    let consumer = dir.path().join("c.db");
    let consumer = consumer.to_str().unwrap();
    crate::support::ok(&["init", "--consumer-db", consumer]);
    let run = run_with(&["prune", "--consumer-db", consumer], &[], None);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stderr.contains("tidemark prune: 1 after") && run.stderr.contains("done: pruned"), "{}", run.stderr);
    assert_eq!(run.json["outcome"], "pruned");
}
