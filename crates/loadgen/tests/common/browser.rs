//! Headless Chromium for the dashboard's tests (`tests/ui.rs`, `tests/ui_token.rs`,
//! `tests/ui_trace.rs`): Debian's `chromium` driven through `chromedriver` over WebDriver, and
//! the element reads and clicks they share.

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

/// The text of the element with this test id, waiting up to 10 s for it. The cards are
/// rebuilt when their set changes (speculation or reuse cards appear), so an element found just
/// before may be gone when read: it is found again.
pub async fn text(browser: &Client, testid: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = browser
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(id(testid))
            .await
            .unwrap_or_else(|e| panic!("element {testid}: {e}"));
        match found.text().await {
            Ok(text) => return text,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("element {testid}: {e}"),
        }
    }
}

/// A DOM property of the element with this test id.
pub async fn prop(browser: &Client, testid: &str, name: &str) -> Option<String> {
    browser
        .find(id(testid))
        .await
        .unwrap_or_else(|e| panic!("element {testid}: {e}"))
        .prop(name)
        .await
        .unwrap()
}

/// Whether the element with this test id (a button) is disabled.
pub async fn disabled(browser: &Client, testid: &str) -> bool {
    prop(browser, testid, "disabled").await.as_deref() == Some("true")
}

/// Whether the element with this test id has its `hidden` property off.
pub async fn not_hidden(browser: &Client, testid: &str) -> bool {
    prop(browser, testid, "hidden").await.as_deref() == Some("false")
}

/// Clicks the element with this test id.
pub async fn click(browser: &Client, testid: &str) {
    browser
        .find(id(testid))
        .await
        .unwrap_or_else(|e| panic!("element {testid}: {e}"))
        .click()
        .await
        .unwrap();
}
