//! Headless Chromium for the dashboard's tests (`tests/ui.rs`, `tests/ui_token.rs`): Debian's
//! `chromium` driven through `chromedriver` over WebDriver.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

/// A chromedriver process on a free port, killed on drop.
pub struct ChromeDriver {
    child: Child,
    port: u16,
}

impl ChromeDriver {
    pub fn start() -> ChromeDriver {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "chromedriver runs the UI tests: install Debian's chromium and chromium-driver \
                 (`apt-get install chromium chromium-driver`; .ci/run does)",
            );
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        ChromeDriver { child, port }
    }

    pub async fn browser(&self) -> Client {
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_owned(),
            json!({"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--window-size=1400,2400"]}),
        );
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a headless Chromium session")
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The test id selector.
pub fn id(testid: &str) -> Locator<'_> {
    Locator::XPath(Box::leak(
        format!("//*[@data-testid='{testid}']").into_boxed_str(),
    ))
}
