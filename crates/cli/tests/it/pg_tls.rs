//! TLS client certificates on a PostgreSQL cluster of the test's own (`pg_cluster`): a CA made
//! by the test signs the server's certificate (for `localhost`) and a client certificate whose
//! common name is the role it logs in as; `pg_hba.conf` lets that role in over TLS with `cert`
//! authentication only. A store URL with `sslcert` and `sslkey` opens, its connection encrypted
//! and authenticated by the certificate (the server's `pg_stat_ssl` shows the client's name);
//! without them, or with a certificate of another CA, the server refuses; the typed refusals
//! of the URL itself write nothing.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::pg_cluster::Cluster;
use crate::support::{path_str, run};

/// A CA, a server certificate for `localhost` and a client certificate for `user`, written as
/// PEM files into `dir`: `ca.crt`, `server.crt`, `server.key`, `client.crt`, `client.key`.
fn certificates(dir: &Path, user: &str) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "tidemark test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let server_cert = server.signed_by(&server_key, &ca_cert, &ca_key).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
    client.distinguished_name.push(DnType::CommonName, user);
    let client_cert = client.signed_by(&client_key, &ca_cert, &ca_key).unwrap();
    for (name, pem) in [
        ("ca.crt", ca_cert.pem()),
        ("server.crt", server_cert.pem()),
        ("server.key", server_key.serialize_pem()),
        ("client.crt", client_cert.pem()),
        ("client.key", client_key.serialize_pem()),
    ] {
        std::fs::write(dir.join(name), pem).unwrap();
    }
}

#[test]
fn a_client_certificate_logs_in_where_the_server_takes_certificates_only() {
    let Some(mut cluster) = Cluster::create() else { return };
    let data = cluster.data();
    certificates(&data, "certuser");
    // The server's key must be its own user's and private to it.
    let owner = std::fs::metadata(&data).unwrap();
    for name in ["ca.crt", "server.crt", "server.key"] {
        let file = data.join(name);
        std::os::unix::fs::chown(&file, Some(owner.uid()), Some(owner.gid())).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let conf = data.join("postgresql.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'ca.crt'\n");
    std::fs::write(&conf, text).unwrap();
    // `certuser` only over TLS with a certificate of the CA; `postgres` (the test's own
    // connections) as before.
    let hba = "hostssl all certuser 127.0.0.1/32 cert\nhost all certuser 127.0.0.1/32 reject\n\
               host all postgres 127.0.0.1/32 trust\nlocal all all trust\n";
    std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
    cluster.start();
    let mut admin = postgres::Client::connect(&cluster.conn(), postgres::NoTls).unwrap();
    admin.batch_execute("CREATE ROLE certuser LOGIN; GRANT CREATE ON DATABASE postgres TO certuser").unwrap();

    // The client's files are the test process's, read by tidemark; `other/` is a certificate
    // for the same role from another CA.
    let mine = tempfile::tempdir().unwrap();
    for name in ["ca.crt", "client.crt", "client.key"] {
        std::fs::copy(data.join(name), mine.path().join(name)).unwrap();
    }
    std::fs::create_dir(mine.path().join("other")).unwrap();
    certificates(&mine.path().join("other"), "certuser");
    let file = |name: &str| path_str(&mine.path().join(name)).to_string();
    let base = format!(
        "postgres://certuser@localhost:{}/postgres?connect_timeout=5&sslmode=verify-full&sslrootcert={}",
        cluster.port(),
        file("ca.crt")
    );
    let store = |extra: &str, schema: &str| format!("{base}{extra}&schema={schema}");
    let with_cert = format!("&sslcert={}&sslkey={}", file("client.crt"), file("client.key"));

    let r = run(&["init", "--producer", &store(&with_cert, "shop"), "--source", "shop"]);
    assert_eq!(r.code, 0, "a client certificate logs in: {}{}", r.stdout, r.stderr);
    let mut held = tidemark_store_postgres::connect(&format!("{base}{with_cert}")).expect("a client certificate");
    let (encrypted, dn): (bool, String) = held
        .query_one("SELECT ssl, coalesce(client_dn, '') FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert!(encrypted && dn.contains("certuser"), "encrypted, the client's certificate seen: {dn}");

    // Refused by the server: no certificate, and a certificate of another CA.
    let r = run(&["init", "--producer", &store("", "shop2"), "--source", "shop"]);
    assert_ne!(r.code, 0, "no certificate: {}", r.stdout);
    let other = format!("&sslcert={}&sslkey={}", file("other/client.crt"), file("other/client.key"));
    let r = run(&["init", "--producer", &store(&other, "shop3"), "--source", "shop"]);
    assert_ne!(r.code, 0, "a certificate of another CA: {}", r.stdout);
    // Refused by tidemark before connecting: half a client certificate.
    let half = format!("&sslcert={}", file("client.crt"));
    let r = run(&["init", "--producer", &store(&half, "shop4"), "--source", "shop"]);
    assert_eq!((r.code, r.json["error"]["code"].as_str()), (2, Some("invalid_argument")), "{}", r.stdout);
    let schemas: i64 = admin
        .query_one("SELECT count(*) FROM pg_namespace WHERE nspname IN ('shop2', 'shop3', 'shop4')", &[])
        .unwrap()
        .get(0);
    assert_eq!(schemas, 0, "nothing written by a refused store");
}
