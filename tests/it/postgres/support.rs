//! The PostgreSQL test support itself: fresh databases on a real server, a stop that refuses
//! connections and a resume that keeps the data, and authentication that is really on.

use crate::support::postgres::Postgres;

#[tokio::test]
async fn databases_are_distinct_and_answer() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let first = postgres.database();
    let second = postgres.database();
    assert_ne!(first.name(), second.name());
    assert_ne!(first.url(), second.url());
    assert_eq!(first.psql("SELECT 1"), "1");
    assert_eq!(second.psql("SELECT 1"), "1");
    assert_eq!(
        first.psql("SELECT current_user || ' ' || current_database()"),
        format!("proxy_operator {}", first.name())
    );
    assert_eq!(
        first.psql(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()"
        ),
        "proxy_operator",
        "the test role owns its database"
    );
    first.psql("CREATE TABLE only_here (v int)");
    assert_eq!(
        second.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'only_here'"),
        "0"
    );

    // The URL is what a client (the operator's own driver) connects with.
    let (client, connection) = tokio_postgres::connect(&first.url(), tokio_postgres::NoTls)
        .await
        .expect("tokio-postgres connects with the database's URL");
    let connection = tokio::spawn(connection);
    let row = client
        .query_one("SELECT 41 + 1", &[])
        .await
        .expect("SELECT over the URL's connection");
    assert_eq!(row.get::<_, i32>(0), 42);
    drop(client);
    connection
        .await
        .expect("the connection task")
        .expect("the connection closes cleanly");
}

#[test]
fn databases_are_created_in_parallel() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let names: std::collections::BTreeSet<String> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    let database = postgres.database();
                    assert_eq!(database.psql("SELECT 1"), "1");
                    database.name().to_owned()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| thread.join().expect("a thread creating a database"))
            .collect()
    });
    assert_eq!(names.len(), 8, "{names:?}");
}

#[tokio::test]
async fn stop_refuses_connections_and_resume_keeps_the_data() {
    let Some(postgres) = Postgres::start() else {
        return;
    };
    let database = postgres.database();
    database
        .psql("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('written before the stop')");
    let (client, connection) = tokio_postgres::connect(&database.url(), tokio_postgres::NoTls)
        .await
        .expect("connect before the stop");
    let connection = tokio::spawn(connection);

    postgres.stop();
    let refused = database
        .try_psql("SELECT 1")
        .expect_err("a stopped server refuses connections");
    assert!(refused.contains("Connection refused"), "{refused}");
    // A fast shutdown aborts open connections, as a failover does.
    client
        .simple_query("SELECT 1")
        .await
        .expect_err("a connection open across the stop is gone");
    connection
        .await
        .expect("the connection task")
        .expect_err("the server ended the connection");

    postgres.resume();
    assert_eq!(
        database.psql("SELECT v FROM kept"),
        "written before the stop"
    );
}

#[test]
fn a_wrong_password_is_refused() {
    let Some(postgres) = Postgres::shared() else {
        return;
    };
    let database = postgres.database();
    let refused = database
        .with_password("not-the-password")
        .try_psql("SELECT 1")
        .expect_err("a wrong password is refused");
    assert!(
        refused.contains("password authentication failed for user \"proxy_operator\""),
        "{refused}"
    );
    let refused = database
        .with_password("")
        .try_psql("SELECT 1")
        .expect_err("no password is refused");
    assert!(refused.contains("no password supplied"), "{refused}");
    assert_eq!(database.psql("SELECT 1"), "1");
}
