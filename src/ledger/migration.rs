//! A numbered SQL file a backend applies at open, and the check that a backend's list names
//! every file of its directory, in order and as on disk.

/// One numbered SQL file from `migrations/` (SQLite) or `migrations/postgres/`.
pub(crate) struct Migration {
    /// File name, for logs.
    pub name: &'static str,
    /// The SQL it runs.
    pub sql: &'static str,
}

/// Asserts that `migrations` are the SQL files of `dir` (directories aside), numbered from
/// `0001_` in order, each as on disk.
#[cfg(test)]
pub(crate) fn assert_lists_directory(dir: &std::path::Path, migrations: &[Migration]) {
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_type().unwrap().is_file())
        .map(|entry| entry.file_name().into_string().unwrap())
        .collect();
    files.sort();
    let names: Vec<&str> = migrations.iter().map(|m| m.name).collect();
    assert_eq!(files, names);
    for (index, migration) in migrations.iter().enumerate() {
        let prefix = format!("{:04}_", index + 1);
        assert!(migration.name.starts_with(&prefix), "{}", migration.name);
        let on_disk = std::fs::read_to_string(dir.join(migration.name)).unwrap();
        assert_eq!(on_disk, migration.sql, "{}", migration.name);
    }
}
