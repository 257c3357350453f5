//! Chat templates from files are an operator's code, run with minijinja's fuel and recursion
//! limits (`text::template`): one that fails on any chat stops `kvroute gateway` / `kvroute
//! engine` at start-up; one that fails on some chats answers those with a 500 OpenAI error
//! naming its file, and keeps serving the others. A template that refuses a chat
//! (`raise_exception`) is the client's business: 400, from the gateway and the engine alike.

mod common;

use common::{Server, failure, post_json};

/// A temporary directory, removed on drop.
struct Dir(std::path::PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("kvroute-tpl-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    /// Writes a `tokenizer_config.json` with `template` as its `chat_template`.
    fn config(&self, file: &str, template: &str) -> String {
        let path = self.0.join(file);
        let json = serde_json::json!({"bos_token": "<|begin_of_text|>", "chat_template": template});
        std::fs::write(&path, json.to_string()).unwrap();
        path.display().to_string()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const ENDLESS: &str =
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";

/// Loops without end on chats of more than three messages.
const ENDLESS_ON_LONG_CHATS: &str = "{% if messages | length > 3 %}{% for i in range(100000) %}\
     {% for j in range(100000) %}x{% endfor %}{% endfor %}{% endif %}{{ bos_token }}\
     {% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ";

#[test]
fn a_template_that_never_ends_stops_start_up_naming_its_file() {
    let dir = Dir::new("endless");
    let config = dir.config("tokenizer_config.json", ENDLESS);
    let stderr = failure(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        "http://127.0.0.1:9",
        "--tokenizer-config",
        &config,
    ]);
    assert!(
        stderr.contains(&config) && stderr.contains("more work than this conversation allows"),
        "{stderr}"
    );
    let template = dir.0.join("endless.jinja");
    std::fs::write(&template, ENDLESS).unwrap();
    let template = template.display().to_string();
    let stderr = failure(&["engine", "--port", "0", "--chat-template", &template]);
    assert!(
        stderr.contains(&format!("--chat-template {template}"))
            && stderr.contains("more work than this conversation allows"),
        "{stderr}"
    );
}

#[test]
fn a_template_that_never_ends_on_some_chats_answers_them_500_naming_its_file() {
    let dir = Dir::new("some");
    let config = dir.config("tokenizer_config.json", ENDLESS_ON_LONG_CHATS);
    let engine = Server::start(&["engine", "--port", "0", "--speedup", "50"]);
    let gateway = Server::start(&[
        "gateway",
        "--port",
        "0",
        "--worker",
        &engine.url,
        "--tokenizer-config",
        &config,
    ]);
    let chat = |n: usize| {
        let messages: Vec<_> = (0..n)
            .map(|i| {
                let role = ["user", "assistant"][i % 2];
                serde_json::json!({"role": role, "content": "hi"})
            })
            .collect();
        post_json(
            gateway.addr(),
            "/v1/chat/completions",
            &serde_json::json!({"model": "llama-3.1-70b-instruct", "messages": messages, "max_tokens": 2}),
        )
    };
    let (status, body) = chat(5);
    assert_eq!(status, 500, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("the chat template of {config} failed"))
            && message.contains("more work than this conversation allows"),
        "{body}"
    );
    let (status, body) = chat(1);
    assert_eq!(status, 200, "shorter chats are served: {body}");
}

/// Refuses a system message (as some models' templates do) and loops without end on chats of
/// more than three messages.
const REFUSES_SYSTEM_ENDLESS_ON_LONG_CHATS: &str = "{% if messages[0].role == 'system' %}\
     {{ raise_exception('this model takes no system message') }}{% endif %}\
     {% if messages | length > 3 %}{% for i in range(100000) %}\
     {% for j in range(100000) %}x{% endfor %}{% endfor %}{% endif %}{{ bos_token }}\
     {% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ";

#[test]
fn the_engine_answers_a_refused_chat_400_and_a_failing_template_500() {
    let dir = Dir::new("engine");
    let template = dir.0.join("template.jinja");
    std::fs::write(&template, REFUSES_SYSTEM_ENDLESS_ON_LONG_CHATS).unwrap();
    let template = template.display().to_string();
    let engine = Server::start(&[
        "engine",
        "--port",
        "0",
        "--speedup",
        "50",
        "--chat-template",
        &template,
    ]);
    let chat = |roles: &[&str]| {
        let messages: Vec<_> = roles
            .iter()
            .map(|role| serde_json::json!({"role": role, "content": "hi"}))
            .collect();
        post_json(
            engine.addr(),
            "/v1/chat/completions",
            &serde_json::json!({"model": "llama-3.1-70b-instruct", "messages": messages, "max_tokens": 2}),
        )
    };
    let (status, body) = chat(&["system", "user"]);
    assert_eq!(status, 400, "the template refused the chat: {body}");
    assert_eq!(body["error"]["param"], "messages", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("this model takes no system message")),
        "{body}"
    );
    let (status, body) = chat(&["user", "assistant", "user", "assistant", "user"]);
    assert_eq!(status, 500, "the template itself failed: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("more work than this conversation allows")),
        "{body}"
    );
    let (status, body) = chat(&["user"]);
    assert_eq!(status, 200, "other chats are served: {body}");
}
