import http.client, json
conn = http.client.HTTPConnection("localhost", 18400, timeout=30)
conn.request("POST", "/v2/models/word_stream/generate_stream", json.dumps({"text_input": "a b c d e f g h i j k l", "delay_ms": 200}))
r = conn.getresponse(); n = 0
try:
    for line in r:
        if line.startswith(b"data:"): n += 1
    print("clean end after", n)
except Exception as e:
    print("raised", type(e).__name__, e, "after", n)
