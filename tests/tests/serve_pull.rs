//! `memleak serve` pulled from as a node agent is, with no protocol of
//! its own: the node-wide `/debug/pprof/allocs` (the path Pyroscope's and
//! Parca's scrapers ask for) read by `go tool pprof`, a process per
//! label; Debian's Prometheus finding each process through `/api/v1/sd`;
//! and `--listen` in the forms Prometheus exporters take.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    process::Command,
};

use memleak_tests::{
    assert_refused_in_one_line,
    fixtures::optimized,
    http::{free_port, get, get_with, serve, stop},
    prometheus::Prometheus,
    tempdir::TempDir,
    Leaker, Memleak,
};
use serde_json::Value;

const TOKEN: &str = "s3cret-t0ken-for-pull-tests";

/// Two processes of two programs, each leaking a known number of bytes:
/// the leaker's `all` (17,264 bytes) and its -O2 build taking two steps
/// (2 x 8,192 bytes).
struct TwoLeakers {
    all: Leaker,
    steps: Leaker,
}

impl TwoLeakers {
    fn start() -> Self {
        let all = Leaker::start_waiting(&["all"]);
        let mut command = Command::new(optimized("leaker"));
        command.args(["steps", "--wait"]);
        let steps = Leaker::start_command(command);
        Self { all, steps }
    }

    /// Lets both allocate, once memleak follows them.
    fn go(&mut self) {
        self.all.go();
        self.steps.go();
        self.steps.send("step", "stepped");
        self.steps.send("step", "stepped");
    }

    fn programs(&self) -> [(u32, String, u64); 2] {
        let program = |leaker: &Leaker| {
            fs::read_link(format!("/proc/{}/exe", leaker.pid()))
                .expect("the leaker's exe")
                .display()
                .to_string()
        };
        [(self.all.pid(), program(&self.all), 17_264), (self.steps.pid(), program(&self.steps), 16_384)]
    }
}

/// `memleak serve --pid A --pid B` with a token, once both leaked.
fn serve_two(extra: &[&str]) -> (TwoLeakers, Memleak, u16, TempDir) {
    let mut leakers = TwoLeakers::start();
    let directory = TempDir::new("memleak-pull");
    let token_file = directory.path().join("token");
    fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    let (all, steps) = (leakers.all.pid().to_string(), leakers.steps.pid().to_string());
    let mut args = vec!["--pid", &all, "--pid", &steps, "--token-file", token_file.to_str().expect("UTF-8")];
    args.extend_from_slice(extra);
    let (memleak, port) = serve(&args);
    leakers.go();
    (leakers, memleak, port, directory)
}

/// The lines `go tool pprof -tags` prints for tag `key`: (value, bytes).
fn tag_values(tags: &str, key: &str) -> Vec<(String, String)> {
    let mut lines =
        tags.lines().skip_while(|line| line.trim() != format!("{key}: Total {}", total_of(tags, key)));
    lines.next();
    lines
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| {
            let (bytes, value) = line.trim().split_once(" (")?;
            let value = value.split_once("): ")?.1;
            Some((value.to_owned(), bytes.to_owned()))
        })
        .collect()
}

fn total_of<'a>(tags: &'a str, key: &str) -> &'a str {
    let header = format!("{key}: Total ");
    tags.lines()
        .find_map(|line| line.trim().strip_prefix(&header))
        .unwrap_or_else(|| panic!("no {key} tag in:\n{tags}"))
}

/// What go tool pprof is told to show of a profile: the outstanding bytes.
const INUSE: &str = "-sample_index=inuse_space";

/// The sample type `go tool pprof` shows of a profile when not told one;
/// `body` is saved in `directory` as `name` for it.
fn sample_type_shown_first(directory: &std::path::Path, name: &str, body: &[u8]) -> String {
    let profile = directory.join(name);
    fs::write(&profile, body).expect("save the profile");
    let top = memleak_tests::go_pprof(&profile, &["-top"]);
    let shown = top.lines().find_map(|line| line.strip_prefix("Type: "));
    shown.unwrap_or_else(|| panic!("no Type: line in {top}")).to_owned()
}

#[test]
fn go_tool_pprof_reads_each_process_of_the_node_wide_allocs_profile_under_its_labels() {
    let (mut leakers, mut memleak, port, directory) = serve_two(&["--verbose"]);
    let programs = leakers.programs();
    let bearer = [("Authorization", format!("Bearer {TOKEN}"))];
    let bearer: Vec<(&str, &str)> = bearer.iter().map(|(name, value)| (*name, value.as_str())).collect();
    // Once both processes' reports hold what they leaked.
    for (pid, _, bytes) in &programs {
        let path = format!("/api/v1/report?pid={pid}&format=json");
        let wanted = format!("\"total_bytes\":{bytes},");
        let deadline = std::time::Instant::now() + memleak_tests::PATIENCE;
        while !get_with(port, &path, &bearer).expect("GET a report").body.contains(&wanted) {
            assert!(std::time::Instant::now() < deadline, "{path}: never {wanted}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
    // No query at all, as Pyroscope and Parca ask; the profile saved
    // first so that go tool pprof reads it without a token.
    let allocs = get_with(port, "/debug/pprof/allocs", &bearer).expect("GET /debug/pprof/allocs");
    assert_eq!(allocs.status, 200, "{allocs:#?}");
    assert_eq!(&allocs.bytes[..2], [0x1f, 0x8b], "gzipped, as Go's net/http/pprof serves it");
    // Saved; as Go's handler serves it, allocs shows what was allocated first.
    assert_eq!(sample_type_shown_first(directory.path(), "allocs.pb.gz", &allocs.bytes), "alloc_space");
    let profile = directory.path().join("allocs.pb.gz");
    let tags = memleak_tests::go_pprof(&profile, &["-tags", "-unit=byte", INUSE]);
    let mut by_pid = tag_values(&tags, "pid");
    by_pid.sort();
    let mut wanted_by_pid: Vec<(String, String)> =
        programs.iter().map(|(pid, _, bytes)| (pid.to_string(), format!("{bytes}.0B"))).collect();
    wanted_by_pid.sort();
    assert_eq!(by_pid, wanted_by_pid, "each process's outstanding bytes under its pid:\n{tags}");
    let mut by_program = tag_values(&tags, "program");
    by_program.sort();
    let mut wanted_by_program: Vec<(String, String)> =
        programs.iter().map(|(_, program, bytes)| (program.clone(), format!("{bytes}.0B"))).collect();
    wanted_by_program.sort();
    assert_eq!(by_program, wanted_by_program, "and under its program:\n{tags}");
    // Each process's stacks are its own: the -O2 build's steps, and
    // nothing of the other's, under its program (a pid would be taken
    // for a number by -tagfocus).
    let focused =
        memleak_tests::go_pprof(&profile, &["-top", "-unit=byte", INUSE, "-tagfocus=program=leaker-O2"]);
    assert!(focused.contains("accounting for 16384B, 48.69% of 33648B total"), "{focused}");
    let step_row = focused.lines().find(|line| line.trim_end().ends_with(" step_leak"));
    assert!(step_row.is_some_and(|row| row.trim_start().starts_with("16384B 48.69%")), "{focused}");
    assert!(!focused.contains("leak_malloc"), "the other process's stacks are not its: {focused}");

    // ?seconds=N, as a scraper of deltas sends it: of every process, what
    // the window left outstanding, one step of the -O2 build.
    let windowed = std::thread::spawn({
        let bearer = format!("Bearer {TOKEN}");
        move || get_with(port, "/debug/pprof/allocs?seconds=3", &[("Authorization", &bearer)])
    });
    memleak
        .stderr
        .wait_for("the window to begin", |line| line.ends_with("every process: a window of 3 s begins"));
    leakers.steps.send("step", "stepped");
    let window = windowed.join().expect("the windowed request").expect("GET ?seconds=3");
    assert_eq!(window.status, 200, "{window:#?}");
    let window_file = directory.path().join("window.pb.gz");
    fs::write(&window_file, &window.bytes).expect("save the window");
    let tags = memleak_tests::go_pprof(&window_file, &["-tags", "-unit=byte", INUSE]);
    let steps_pid = programs[1].0.to_string();
    assert_eq!(tag_values(&tags, "pid"), [(steps_pid, "8192.0B".to_owned())], "{tags}");

    // The same profile at /debug/pprof/heap, what is outstanding shown
    // first, and the token wanted for it.
    let heap = get_with(port, "/debug/pprof/heap", &bearer).expect("GET /debug/pprof/heap");
    assert_eq!(heap.status, 200, "{heap:#?}");
    assert_eq!(sample_type_shown_first(directory.path(), "heap.pb.gz", &heap.bytes), "inuse_space");
    let unauthorized = get(port, "/debug/pprof/allocs").expect("GET without the token");
    assert_eq!(unauthorized.status, 401, "{unauthorized:#?}");
    drop(leakers);
    stop(memleak);
}

#[test]
fn prometheus_finds_each_process_through_the_sd_list_and_stores_its_bytes_under_its_labels() {
    let (leakers, memleak, port, directory) = serve_two(&[]);
    let programs = leakers.programs();
    let token_file = directory.path().join("token");
    let token_file = token_file.display();
    // As a DaemonSet's scrape config would be: the list, and every scrape,
    // with the token; the processes' own labels kept as they are. The
    // list's `type: Bearer` is not said for nothing: Prometheus 2.42 sends
    // an http_sd_configs' credentials bare without it.
    let prometheus = Prometheus::configured(&format!(
        "  - job_name: memleak\n    honor_labels: true\n    authorization:\n      credentials_file: {token_file}\n    \
         http_sd_configs:\n      - url: http://127.0.0.1:{port}/api/v1/sd\n        refresh_interval: 1s\n        \
         authorization:\n          type: Bearer\n          credentials_file: {token_file}\n"
    ));
    for (pid, program, bytes) in &programs {
        let query = format!("memleak_outstanding_bytes{{job=\"memleak\",pid=\"{pid}\"}}");
        let series =
            prometheus.query_until(&query, |series| series.len() == 1 && series[0].1 == bytes.to_string());
        let labels = &series[0].0;
        assert_eq!(labels["program"], program.as_str(), "the list's label: {labels}");
        assert_eq!(labels["exe"], program.rsplit('/').next().unwrap(), "the series' own: {labels}");
        assert_eq!(labels["instance"], format!("127.0.0.1:{port}"), "{labels}");
    }
    // A target per process, each scraped for its own series alone:
    // memleak's own (map fill) are for the scrape of the whole.
    let up = prometheus.query("up{job=\"memleak\"}");
    assert_eq!(up.len(), 2, "{up:?}");
    assert!(up.iter().all(|(_, value)| value == "1"), "{up:?}");
    assert!(prometheus.query("memleak_map_entries").is_empty());

    // What Prometheus read: the list itself.
    let bearer = format!("Bearer {TOKEN}");
    let list = get_with(port, "/api/v1/sd", &[("Authorization", &bearer)]).expect("GET /api/v1/sd");
    assert_eq!(list.content_type.as_deref(), Some("application/json"));
    let list: Value =
        serde_json::from_str(&list.body).unwrap_or_else(|error| panic!("{error}: {}", list.body));
    let mut entries = list.as_array().expect("a list").clone();
    entries
        .sort_by_key(|entry| entry["labels"]["pid"].as_str().unwrap_or_default().parse::<u32>().unwrap_or(0));
    let wanted: Vec<Value> = programs
        .iter()
        .map(|(pid, program, _)| {
            serde_json::json!({
                "targets": [format!("127.0.0.1:{port}")],
                "labels": {"__param_pid": pid.to_string(), "pid": pid.to_string(), "program": program},
            })
        })
        .collect();
    let mut wanted = wanted;
    wanted
        .sort_by_key(|entry| entry["labels"]["pid"].as_str().unwrap_or_default().parse::<u32>().unwrap_or(0));
    assert_eq!(entries, wanted);
    assert_eq!(get(port, "/api/v1/sd").expect("GET without the token").status, 401);
    drop(prometheus);
    drop(leakers);
    stop(memleak);
}

/// The status line of `GET path` from `address`, or why nothing answered.
fn status_at(address: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(address)?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: memleak\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response.lines().next().unwrap_or_default().to_owned())
}

/// The body of `GET path` from 127.0.0.1:`port` with the token.
fn body_with_token(port: u16, path: &str) -> String {
    let bearer = format!("Bearer {TOKEN}");
    let response = get_with(port, path, &[("Authorization", &bearer)]).expect("GET with the token");
    assert_eq!(response.status, 200, "{path}: {response:#?}");
    response.body
}

/// A --listen form: the flags, `POD_IP` if set, where the daemon must
/// answer and where not, and the address /api/v1/sd must name.
struct ListenCase {
    flags: Vec<String>,
    pod_ip: Option<&'static str>,
    answers: SocketAddr,
    silent: Option<SocketAddr>,
    advertised: String,
}

/// The forms, each on a port of its own.
fn listen_cases() -> [ListenCase; 4] {
    let v4 = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let v6 = |port: u16| SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let ports = [free_port(), free_port(), free_port(), free_port()];
    [
        ListenCase {
            flags: vec!["--listen".into(), format!("127.0.0.1:{}", ports[0])],
            pod_ip: None,
            answers: v4(ports[0]),
            silent: Some(v6(ports[0])),
            advertised: format!("127.0.0.1:{}", ports[0]),
        },
        ListenCase {
            flags: vec!["--listen".into(), format!("[::1]:{}", ports[1])],
            pod_ip: None,
            answers: v6(ports[1]),
            silent: Some(v4(ports[1])),
            advertised: format!("[::1]:{}", ports[1]),
        },
        // Every IPv4 address, as exporters read :PORT; the pod's address
        // named, as a DaemonSet sets POD_IP.
        ListenCase {
            flags: vec!["--listen".into(), format!(":{}", ports[2])],
            pod_ip: Some("10.1.2.3"),
            answers: v4(ports[2]),
            silent: Some(v6(ports[2])),
            advertised: format!("10.1.2.3:{}", ports[2]),
        },
        ListenCase {
            flags: [
                "--listen",
                "127.0.0.1",
                "--port",
                &ports[3].to_string(),
                "--advertise",
                "node-a.example:80",
            ]
            .map(str::to_owned)
            .to_vec(),
            pod_ip: None,
            answers: v4(ports[3]),
            silent: None,
            advertised: "node-a.example:80".to_owned(),
        },
    ]
}

#[test]
fn each_listen_form_binds_where_it_says_and_sd_names_the_address_advertised() {
    let leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid().to_string();
    let directory = TempDir::new("memleak-listen");
    let token_file = directory.path().join("token");
    fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token");
    let token = token_file.to_str().expect("UTF-8");
    for ListenCase { flags, pod_ip, answers, silent, advertised } in listen_cases() {
        let port = answers.port();
        let mut args = vec!["serve", "--pid", &pid, "--token-file", token];
        args.extend(flags.iter().map(String::as_str));
        let env: Vec<(&str, &str)> = pod_ip.map(|ip| ("POD_IP", ip)).into_iter().collect();
        let mut memleak = Memleak::start_with_env(&args, &env);
        let serving =
            memleak.stderr.wait_for("memleak to serve", |line| line.starts_with("memleak: serving http://"));
        assert!(serving.contains(&format!(":{port}/")), "{flags:?}: {serving}");
        assert_eq!(status_at(answers, "/healthz").expect("GET /healthz"), "HTTP/1.1 200 OK", "{flags:?}");
        if let Some(silent) = silent {
            assert!(status_at(silent, "/healthz").is_err(), "{flags:?}: {silent} answers too");
        }
        if answers.is_ipv4() {
            let list: Value = serde_json::from_str(&body_with_token(port, "/api/v1/sd")).expect("JSON");
            assert_eq!(list[0]["targets"], serde_json::json!([advertised]), "{flags:?}: {list}");
        }
        stop(memleak);
    }
    drop(leaker);
}

#[test]
fn a_bad_listen_or_advertise_is_refused_in_one_line() {
    let pid = std::process::id().to_string();
    assert_refused_in_one_line(
        &["serve", "--pid", &pid, "--listen", "localhost:9943"],
        "invalid value `localhost:9943` for `--listen <ADDR>`: `localhost:9943` is not an address to listen on",
    );
    assert_refused_in_one_line(&["serve", "--pid", &pid, "--listen", ":70000"], "`70000` is not a port");
    assert_refused_in_one_line(
        &["serve", "--pid", &pid, "--listen", "127.0.0.1:9000", "--port", "9001"],
        "--listen 127.0.0.1:9000 names its port already: drop --port 9001, or give --listen 127.0.0.1 --port 9001",
    );
    assert_refused_in_one_line(&["serve", "--pid", &pid, "--listen", ":9943"], "needs --token-file FILE");
    assert_refused_in_one_line(
        &["serve", "--pid", &pid, "--advertise", "10.0.0.7"],
        "`10.0.0.7` is not HOST:PORT",
    );
}
