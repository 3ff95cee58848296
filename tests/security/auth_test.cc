// TokenAuthenticator and the method -> role table, without a server.
#include "server/security/auth.h"

#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {
namespace {

constexpr char kReader[] = "reader-token-0123456789";
constexpr char kWriter[] = "writer-token-0123456789";

std::shared_ptr<const TokenAuthenticator> Tokens() {
  auto auth = TokenAuthenticator::FromText(
      "# comment line\n"
      "\n"
      "reader reader-token-0123456789   # trailing comment\n"
      "  writer\twriter-token-0123456789\n");
  EXPECT_TRUE(auth.ok()) << auth.status();
  return auth.ok() ? *auth : nullptr;
}

TEST(TokenAuthenticatorTest, ParsesRolesAndComments) {
  auto auth = Tokens();
  ASSERT_NE(auth, nullptr);
  EXPECT_EQ(auth->size(), 2u);
  EXPECT_EQ(auth->Authenticate(std::string("Bearer ") + kReader), Role::kReader);
  EXPECT_EQ(auth->Authenticate(std::string("bearer ") + kWriter), Role::kWriter);
  EXPECT_EQ(auth->Authenticate(kWriter), Role::kNone);  // no scheme
  EXPECT_EQ(auth->Authenticate("Bearer "), Role::kNone);
  EXPECT_EQ(auth->Authenticate(""), Role::kNone);
  EXPECT_EQ(auth->Authenticate("Basic d3JpdGVyOnB3"), Role::kNone);
  // A prefix or an extension of a known token is a different token.
  EXPECT_EQ(auth->Authenticate("Bearer writer-token-012345678"), Role::kNone);
  EXPECT_EQ(auth->Authenticate("Bearer writer-token-01234567890"), Role::kNone);
}

TEST(TokenAuthenticatorTest, RefusesBadFiles) {
  for (const char* text : {
           "",                                    // no token
           "# only a comment\n",                  // no token
           "admin admin-token-0123456789\n",      // unknown role
           "writer short\n",                      // shorter than 16
           "writer\n",                            // no token
           "writer a-token-0123456789 extra\n",   // three fields
           "reader same-token-0123456789\nwriter same-token-0123456789\n",  // listed twice
       }) {
    auto auth = TokenAuthenticator::FromText(text);
    EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  // The error names the line, never the token.
  auto auth = TokenAuthenticator::FromText("reader ok-token-0123456789\nwriter tiny-secret\n");
  ASSERT_FALSE(auth.ok());
  EXPECT_NE(auth.status().message().find("line 2"), absl::string_view::npos);
  EXPECT_EQ(auth.status().message().find("tiny-secret"), absl::string_view::npos);
  EXPECT_EQ(TokenAuthenticator::FromFile("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(RequiredAccessTest, EveryLossHeadMethodHasARowAndUnknownOnesAreDenied) {
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/Step"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/PushWeights"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/CreateHead"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/DeleteHead"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/SetLossOptions"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/Checkpoint"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/GetStats"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/GetHead"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/ListHeads"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/PullGradient"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/DownloadWeights"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/EmbeddingRows"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/GetClientProgress"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/ListSnapshots"), Access::kReader);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/RestoreHead"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/DeleteSnapshot"), Access::kWriter);
  EXPECT_EQ(RequiredAccess("/grpc.health.v1.Health/Check"), Access::kOpen);
  EXPECT_EQ(RequiredAccess("/grpc.health.v1.Health/Watch"), Access::kOpen);
  EXPECT_EQ(RequiredAccess("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
            Access::kOpen);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/Nope"), Access::kDenied);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/step"), Access::kDenied);
  EXPECT_EQ(RequiredAccess("/losshead.v1.LossHead/Step/"), Access::kDenied);
  EXPECT_EQ(RequiredAccess(""), Access::kDenied);
  // The whole method list of the service descriptor is covered by the table.
  const auto* service = google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
      "losshead.v1.LossHead");
  ASSERT_NE(service, nullptr);
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string full = "/" + service->full_name() + "/" + service->method(i)->name();
    EXPECT_NE(RequiredAccess(full), Access::kDenied) << full << " has no row in the role table";
  }
}

TEST(TokenAuthenticatorTest, AuthorizeGivesExactCodes) {
  auto auth = Tokens();
  ASSERT_NE(auth, nullptr);
  const std::string reader = std::string("Bearer ") + kReader;
  const std::string writer = std::string("Bearer ") + kWriter;
  const std::string step = "/losshead.v1.LossHead/Step";
  const std::string stats = "/losshead.v1.LossHead/GetStats";
  EXPECT_EQ(auth->Authorize(step, "").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Authorize(step, "Bearer wrong-token-0123456789").code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Authorize(step, reader).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(auth->Authorize(step, writer).ok());
  EXPECT_TRUE(auth->Authorize(stats, reader).ok());
  EXPECT_TRUE(auth->Authorize(stats, writer).ok());
  EXPECT_TRUE(auth->Authorize("/grpc.health.v1.Health/Check", "").ok());
  EXPECT_EQ(auth->Authorize("/losshead.v1.LossHead/Nope", writer).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(auth->Authorize("/losshead.v1.LossHead/Nope", "").code(),
            absl::StatusCode::kUnauthenticated);
  // Messages never carry the token.
  EXPECT_EQ(auth->Authorize(step, reader).message().find(kReader), absl::string_view::npos);
}

}  // namespace
}  // namespace losshead::server
