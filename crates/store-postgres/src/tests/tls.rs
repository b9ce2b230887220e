//! TLS to the server (`sslmode`, `sslrootcert` in a `postgres://` URL): a trusted certificate
//! that names the host connects encrypted; the same server with the Mozilla roots only, or by
//! another name (its address), is refused; no `sslmode` stays plain text; a store opens over TLS.
//! The test server's own certificate is the trust anchor (on Debian the "snakeoil" certificate,
//! made for `localhost`); a server with `ssl = off`, or a certificate that does not name
//! `localhost`, skips the test and says why.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tidemark_core::error::codes;

use super::support::TestDb;
use crate::{connect, PgProducer};

/// The URL of the test server by the name `localhost` (no query), and its certificate file.
fn tls_server(db: &TestDb) -> Option<(String, String)> {
    let mut client = db.client();
    let ssl: String = client.query_one("SHOW ssl", &[]).unwrap().get(0);
    let cert: String = client.query_one("SHOW ssl_cert_file", &[]).unwrap().get(0);
    if ssl != "on" {
        println!("skipped: the test server has ssl = off");
        return None;
    }
    let Ok(der) = CertificateDer::from_pem_file(&cert) else {
        println!("skipped: the server's certificate {cert} is not readable here");
        return None;
    };
    if !der.windows(9).any(|w| w == b"localhost") {
        println!("skipped: the server's certificate {cert} does not name localhost");
        return None;
    }
    let config: postgres::Config = db.conn.parse().unwrap();
    let loopback = config.get_hosts().iter().all(|host| match host {
        postgres::config::Host::Tcp(name) => name == "127.0.0.1" || name == "localhost",
        _ => false,
    });
    if !loopback {
        println!("skipped: the test server is not on this machine's loopback");
        return None;
    }
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    let dbname = config.get_dbname().unwrap_or("postgres");
    Some((format!("postgres://{user}@localhost:{port}/{dbname}"), cert))
}

fn encrypted(client: &mut postgres::Client) -> bool {
    client.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).unwrap().get(0)
}

#[test]
fn sslmode_require_encrypts_and_verifies_the_certificate_and_the_name() {
    let Some(db) = TestDb::new("tls") else { return };
    let Some((base, cert)) = tls_server(&db) else { return };

    let mut client = connect(&format!("{base}?sslmode=require&sslrootcert={cert}")).expect("TLS to a trusted server");
    assert!(encrypted(&mut client), "sslmode=require is encrypted");
    let mut client = connect(&format!("{base}?sslmode=verify-full&sslrootcert={cert}")).unwrap();
    assert!(encrypted(&mut client));
    let mut plain = connect(&base).expect("plain text");
    assert!(!encrypted(&mut plain), "no sslmode is plain text");

    // Not trusted: the Mozilla roots do not hold the server's certificate.
    let error = connect(&format!("{base}?sslmode=require")).err().expect("an untrusted certificate is refused");
    assert_eq!(error.code(), codes::IO, "{error}");
    assert!(error.to_string().contains("certificate"), "{error}");
    // Trusted, but not the name it was made for: the address instead of `localhost`.
    let by_address = base.replace("@localhost:", "@127.0.0.1:");
    let error = connect(&format!("{by_address}?sslmode=require&sslrootcert={cert}")).err().expect("a wrong name");
    assert_eq!(error.code(), codes::IO, "{error}");
    assert!(error.to_string().contains("certificate"), "{error}");

    // A store opens, writes and reads over TLS.
    let schema = db.schema("producer");
    let url = format!("{base}?sslmode=require&sslrootcert={cert}");
    let mut producer = PgProducer::init(&url, &schema, "shop").expect("a producer over TLS");
    assert!(encrypted(producer.client()));
    let committed = producer
        .transaction(1, |tx| {
            tx.advance(&tidemark_core::reservation::ReservationMachine, &super::support::reserve("r-1"))
        })
        .expect("an advance over TLS");
    assert_eq!(committed.seq, 1);
}
